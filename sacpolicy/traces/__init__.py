"""Acceptance traces: schema, live and teacher-forced collection, exact offline replay."""
