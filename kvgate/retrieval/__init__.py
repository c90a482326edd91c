"""Long documents: files, their text, chunks that know where they lie, and retrieval."""
