"""Over-the-air updates on a device (and an edge): verify, download, delta, install, A/B firmware (DESIGN §4.2)."""
