"""Acceptance traces: schema, teacher-forced collection, exact offline replay."""
