"""Tenants: who may use what (tenants file), and admission before the engine."""
