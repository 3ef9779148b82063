"""Developer tools run from the source tree (not shipped in the wheel)."""
