"""Helpers shared by test modules of several tiers (fakes, step drivers, polling)."""
