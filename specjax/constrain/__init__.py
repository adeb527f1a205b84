"""Host-side compiler of structured-answer constraints (regex, JSON schema, choice) to token tables."""

from specjax.constrain.tables import (TokenTables, compile_choice, compile_regex, compile_schema, from_request,
                                      token_bytes)

__all__ = ["TokenTables", "compile_regex", "compile_schema", "compile_choice", "from_request", "token_bytes"]
