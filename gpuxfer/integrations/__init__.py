"""Integrations of gpuxfer into inference engines. Each subpackage imports its engine only when the engine
loads it; importing gpuxfer (or this package) imports no engine."""
