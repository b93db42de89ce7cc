"""Krea 2 components from single files, as ComfyUI users keep them (filled in below)."""
