"""Payload codecs: how pseudo-gradients are compressed for the wire."""
