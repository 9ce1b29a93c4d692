"""Emitters: checked specs -> Python and Triton source."""
