"""The PyTorch reference model (andrea.py), its checkpoints in both layouts (checkpoint.py), GPT-2's names and
config.json (gpt2.py), the text corpus and tokenizer (text.py) and the trained demo (demo.py)."""
