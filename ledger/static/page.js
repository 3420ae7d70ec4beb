// veritrain ledger page: reload an active run's page now and then; nothing else.
(function () {
  "use strict";
  var seconds = Number(document.body.getAttribute("data-refresh"));
  if (seconds > 0) {
    window.setTimeout(function () { window.location.reload(); }, seconds * 1000);
  }
})();
