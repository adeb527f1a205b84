"""Host-side compiler of structured-answer constraints (regex, JSON schema, choice) to token tables."""

from specjax.constrain.tables import TokenTables, compile_regex, compile_schema, compile_choice, token_bytes

__all__ = ["TokenTables", "compile_regex", "compile_schema", "compile_choice", "token_bytes"]
