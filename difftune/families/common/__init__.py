"""Pieces every model family shares, written once: text encoding, folder and single-file
loading, placing and freezing modules, the fused-kohya key handling and the tiny flavors'
shared parts."""
