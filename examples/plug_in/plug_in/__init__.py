"""Plug-in example app."""
