"""AAR next-scale audio generator and SAT tokenizer."""
