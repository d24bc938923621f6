"""TEST DOUBLE of SGLang: exists only to test hostd's orchestration. Not SGLang."""

