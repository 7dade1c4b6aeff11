"""Chat prompts as token ids: templates and tokenizing (prompt_tokens), generated replies' exact ids
(token_history), and the text a generation reads back (text: detokenizing, stop strings)."""
