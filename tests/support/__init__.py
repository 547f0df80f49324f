"""Helpers shared by the test layers (not tests themselves)."""
