"""Oracles the cupa reference is tested against: implementations nobody here wrote (contract §6)."""
