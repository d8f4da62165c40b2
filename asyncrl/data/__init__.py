"""Data: dataset rows in, the prompt's token ids out.

Owns reading a split's rows (`files`: JSONL, JSON, Parquet, and what the `datasets` extra reads; `rows`: the
`data.path` / `data.source` choice, the row checks, dotted field paths and the endless reshuffled
`PromptStream`) and turning a row into the tokens the model is prompted with (`prompts`: messages or a
template, the chat template once, BOS, `data.overlong` screening). It may import the configuration's schema
and a tokenizer it is given; it imports no role, engine or transport, and the generators, the trainer's
evaluator, the environments' transcripts and the rule rewards call it.
"""
