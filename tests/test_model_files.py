"""nanoserve.model_files: what the frontend reads from a model without torch (tokenizer and chat template,
end-of-sequence ids, generation defaults), checked against transformers' own loaders."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from nanoserve.model_files import eos_token_ids, generation_defaults, load_tokenizer

TEXTS = ["Hello world", "  leading spaces\nand lines", "<|im_start|>user\nhi<|im_end|>", "émoji 🚀 中文"]


def test_frontend_reads_a_model_without_torch(bundled_gguf_path, tiny_gqa_dir):
    """The API server's process loads tokenizers (GGUF and folder), EOS ids and defaults: torch stays out."""
    script = textwrap.dedent(
        f"""
        import sys
        import nanoserve.engine.async_llm, nanoserve.entrypoints.openai.api_server
        from nanoserve.model_files import eos_token_ids, generation_defaults, load_tokenizer, model_name
        for path in ({bundled_gguf_path!r}, {str(tiny_gqa_dir)!r}):
            tokenizer = load_tokenizer(path)
            tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False)
            eos_token_ids(path, tokenizer), generation_defaults(path), model_name(path)
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_gguf_tokenizer_equals_transformers(bundled_gguf_path):
    from transformers import AutoTokenizer

    ours = load_tokenizer(bundled_gguf_path)
    folder, name = os.path.split(bundled_gguf_path)
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for text in TEXTS:
        assert ours(text).input_ids == ref(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == ref.decode(ref(text).input_ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token_id, ours.eos_token_id, len(ours)) == (ref.bos_token_id, ref.eos_token_id, len(ref))
    assert ours.all_special_ids == ref.all_special_ids


def test_folder_tokenizer_equals_transformers(tiny_gqa_dir):
    from transformers import AutoTokenizer

    ours, ref = load_tokenizer(str(tiny_gqa_dir)), AutoTokenizer.from_pretrained(tiny_gqa_dir)
    assert type(ours) is type(ref)
    for text in TEXTS:
        assert ours(text).input_ids == ref(text).input_ids, text


def test_every_declared_eos_id_counts(llama3_style_dir, bundled_gguf_path):
    tokenizer = load_tokenizer(str(llama3_style_dir))
    assert eos_token_ids(str(llama3_style_dir), tokenizer) == (tokenizer.eos_token_id, 7, 9)
    assert eos_token_ids(bundled_gguf_path, load_tokenizer(bundled_gguf_path)) == (2,)


def test_generation_defaults(llama3_style_dir, tiny_gqa_dir, bundled_gguf_path):
    assert generation_defaults(str(llama3_style_dir)) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}
    assert generation_defaults(str(tiny_gqa_dir)) == {}  # transformers' own file, no sampling fields
    assert generation_defaults(bundled_gguf_path) == {}
