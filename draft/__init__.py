"""Tooling that makes specpage's default draft model by distillation."""
