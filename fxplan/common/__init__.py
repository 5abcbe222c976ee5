"""Helpers every stage may use: terminal output and the garbage collector's schedule."""
