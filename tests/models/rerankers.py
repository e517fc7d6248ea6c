"""A tiny Qwen3-Reranker for the score tests: a Qwen3ForCausalLM checkpoint (``tiny_qwen3``
with "yes" and "no" added to its vocabulary) served as vLLM serves the real one
(``RERANKER_OVERRIDES``), the model card's prompt as a score template
(``QWEN3_RERANKER_TEMPLATE``) and as the prefix / suffix the caller adds itself
(``card_query`` / ``card_document``), and the model card's scores (``card_scores``:
transformers' p(yes) from the last token's "no" / "yes" logits).

Typical use::

    path = make_qwen3_reranker(tiny_qwen3, tmp / "reranker")
    llm = LLM(str(path), runner="pooling", hf_overrides=RERANKER_OVERRIDES)
    llm.score(query, documents, chat_template=QWEN3_RERANKER_TEMPLATE)  # == card_scores(path, query, documents)
"""

from __future__ import annotations

from pathlib import Path

import torch

#: ``--hf-overrides`` of the original Qwen3-Reranker checkpoints (a Qwen3ForCausalLM) in vLLM's docs.
RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
#: The model card's prompt around its ``<Instruct>`` / ``<Query>`` / ``<Document>`` lines.
CARD_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
               'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

#: The same prompt as a score template (the server's ``--chat-template``): messages of roles
#: "query" and "document"; a "system" message, if any, replaces the instruction. One more
#: newline at the end: Jinja drops a template's last one (as transformers renders it).
QWEN3_RERANKER_TEMPLATE = (
    CARD_PREFIX
    + "<Instruct>: {{ messages | selectattr('role', 'eq', 'system') | map(attribute='content') | first | default('"
    + CARD_INSTRUCTION + "') }}\n"
    "<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') | first }}\n"
    "<Document>: {{ messages | selectattr('role', 'eq', 'document') | map(attribute='content') | first }}"
    + CARD_SUFFIX + "\n"
)


def card_query(query: str) -> str:
    """text_1 of a pair whose prompt the caller builds (vLLM's example): prefix, instruction, query."""
    return f"{CARD_PREFIX}<Instruct>: {CARD_INSTRUCTION}\n<Query>: {query}\n"


def card_document(document: str) -> str:
    """text_2 of such a pair: the document and the suffix."""
    return f"<Document>: {document}{CARD_SUFFIX}"


def make_qwen3_reranker(tiny_qwen3: Path, out: Path) -> Path:
    """``tiny_qwen3`` with tokens "no" and "yes" added (their rows copies of two other tokens',
    the LM head's "yes" moved to a tenth of its distance from "no", so that scores differ by
    document), saved in ``out``; returns ``out``."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_qwen3)
    tokenizer.add_tokens(["no", "yes"])
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    with torch.no_grad():
        for table in {id(t): t for t in (model.get_input_embeddings().weight, model.lm_head.weight)}.values():
            table[no], table[yes] = table[300].clone(), table[301].clone()
        # LM-head rows a tenth of their difference apart: p(yes) near 0.8, not saturated.
        head = model.lm_head.weight
        head[yes] = head[no] + 0.1 * (head[yes] - head[no])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def card_token_ids(tokenizer, query: str, document: str) -> list[int]:
    """The model card's input ids of a pair: prefix, the formatted instruction / query /
    document, and suffix, each tokenized alone."""
    middle = f"<Instruct>: {CARD_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return (tokenizer.encode(CARD_PREFIX, add_special_tokens=False) + tokenizer(middle)["input_ids"]
            + tokenizer.encode(CARD_SUFFIX, add_special_tokens=False))


def card_scores(path: Path, query: str, documents: list[str]) -> torch.Tensor:
    """The model card's scores [len(documents)] (float32): transformers' causal LM on each
    pair's ``card_token_ids``, the last token's logits of "no" and "yes" log-softmaxed, p(yes)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    scores = []
    with torch.no_grad():
        for document in documents:
            logits = model(torch.tensor([card_token_ids(tokenizer, query, document)])).logits[0, -1]
            scores.append(torch.log_softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1].exp())
    return torch.stack(scores)
