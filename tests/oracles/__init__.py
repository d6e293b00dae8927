"""Oracles the cupa reference is tested against: implementations nobody here wrote (SPEC section 6)."""
