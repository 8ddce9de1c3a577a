"""Split inference between a device and its edge (DESIGN §5): where to cut, and the link it is cut for."""
