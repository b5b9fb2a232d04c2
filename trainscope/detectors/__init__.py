"""Detectors: the Detector protocol, the plugin registry and the built-in detectors."""
