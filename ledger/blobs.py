"""Content-addressed blob files on disk.

A blob is written to a temporary file while its sha256 is computed, then
renamed to ``<root>/<h[:2]>/<h>`` only if the hash matches what the writer
declared; a partial or mismatched upload never becomes visible.

The server stages uploads instead (:meth:`BlobWriter.stage`): the checked file stays in
the temporary area until the signed message that references it is accepted, and is
published (renamed into place) by the writer transaction that records it; a refused or
interrupted request deletes its staged file. :meth:`BlobStore.sweep_tmp` and
:meth:`BlobStore.collect_unreferenced` collect what a crash left behind.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from veritrain.protocol.errors import OversizedError, RejectedInput


class HashMismatch(RejectedInput):
    reason = "payload_mismatch"


class BlobPruned(RejectedInput):
    """A blob whose file the retention policy deleted (retention.py): HTTP 410, reason
    ``pruned``, on the server; raised by the client's ``get_blob`` with the server's words."""

    reason = "pruned"


class BlobWriter:
    """Incremental writer: feed chunks, then :meth:`commit` with the expected hash."""

    def __init__(self, store: BlobStore, max_bytes: int) -> None:
        self._store = store
        self._max = max_bytes
        fd, name = tempfile.mkstemp(dir=store.tmp_dir, prefix="up-")
        self._fh = os.fdopen(fd, "wb")
        self._tmp = Path(name)
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self._max:
            self.abort()
            raise OversizedError(f"blob exceeds the limit of {self._max} bytes")
        self._hash.update(chunk)
        self._fh.write(chunk)

    @property
    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def commit(self, expected: str | None = None) -> str:
        digest = self._hash.hexdigest()
        if expected is not None and digest != expected:
            self.abort()
            raise HashMismatch(f"content hash {digest} does not match declared {expected}")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        final = self._store.path_for(digest)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._tmp, final)
        return digest

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        self._tmp.unlink(missing_ok=True)

    def stage(self, expected: str | None = None) -> StagedBlob:
        """Check the hash and keep the file in the temporary area (nothing visible yet):
        :meth:`BlobStore.publish` moves it into place once its message is accepted."""
        digest = self._hash.hexdigest()
        if expected is not None and digest != expected:
            self.abort()
            raise HashMismatch(f"content hash {digest} does not match declared {expected}")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        return StagedBlob(digest, self.size, self._tmp)


@dataclass
class StagedBlob:
    """A complete, hash-checked upload waiting in the temporary area for its message."""

    digest: str
    size: int
    path: Path
    kind: str = ""
    run_id: str | None = None
    sealed_round: int | None = None

    def discard(self) -> None:
        """Delete the staged file (a refused request; a no-op once published)."""
        self.path.unlink(missing_ok=True)


class BlobStore:
    def __init__(self, root: Path, *, owner: bool = True) -> None:
        """``owner``: the ledger process that owns ``root`` (it discards the uploads a
        crash left); another process beside it (``veritrain ledger prune``) leaves them."""
        self.root = root
        self.tmp_dir = root / "tmp"
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        if owner:
            self.discard_partial_uploads()

    def discard_partial_uploads(self) -> int:
        """Remove temp files left by uploads cut short by a crash (one ledger process owns
        the directory, so at start-up every temp file is stale); returns how many."""
        stale = list(self.tmp_dir.glob("up-*"))
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale)

    def publish(self, staged: Iterable[StagedBlob]) -> None:
        """Move staged files into place (called by the transaction that accepts their
        message, before it commits); a file already in place keeps its copy."""
        for blob in staged:
            final = self.path_for(blob.digest)
            if final.exists():
                blob.discard()
                continue
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(blob.path, final)

    def sweep_tmp(self, older_than: float) -> int:
        """Delete temporary files untouched for ``older_than`` seconds (an upload that is
        alive writes at least every idle limit; a staged file waits for one transaction)."""
        limit = time.time() - older_than
        gone = 0
        for path in self.tmp_dir.glob("up-*"):
            try:
                if path.stat().st_mtime < limit:
                    path.unlink()
                    gone += 1
            except FileNotFoundError:
                continue
        return gone

    def digests(self) -> list[str]:
        """Every published file's name."""
        return [p.name for p in self.root.glob("??/*") if len(p.name) == 64]

    def collect_unreferenced(self, referenced: Callable[[list[str]], set[str]]) -> int:
        """Delete published files no blob row names (a crash between publishing and commit,
        or files an older version stored for refused requests); ``referenced`` answers
        which of a batch of digests have rows. Returns how many went."""
        names = self.digests()
        gone = 0
        for k in range(0, len(names), 500):
            batch = names[k:k + 500]
            keep = referenced(batch)
            for digest in batch:
                if digest not in keep:
                    self.remove(digest)
                    gone += 1
        return gone

    def path_for(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError("not a sha256 hex digest")
        return self.root / digest[:2] / digest

    def writer(self, max_bytes: int) -> BlobWriter:
        return BlobWriter(self, max_bytes)

    def put(self, data: bytes, max_bytes: int | None = None) -> str:
        w = self.writer(max_bytes if max_bytes is not None else len(data))
        w.write(data)
        return w.commit()

    def exists(self, digest: str) -> bool:
        return self.path_for(digest).exists()

    def read(self, digest: str) -> bytes:
        return self.path_for(digest).read_bytes()

    def size_of(self, digest: str) -> int | None:
        """The file's size, or None when there is no file (never stored, pruned or lost)."""
        try:
            return self.path_for(digest).stat().st_size
        except FileNotFoundError:
            return None

    def remove(self, digest: str) -> int:
        """Delete the file (retention.py prunes only what it recorded first); the bytes
        freed, 0 when it was already gone."""
        path = self.path_for(digest)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        return size
