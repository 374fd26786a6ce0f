"""The text edge: tokenizer, THE prompt layout, chat templates and text deltas. The engine never sees text."""

from kvfuse.text.chat import CHAT_TEMPLATES, ChatTemplate
from kvfuse.text.deltas import (
    DEFAULT_STOP,
    Completed,
    TextDeltas,
    complete_answer,
    complete_text,
    stream_text,
)
from kvfuse.text.layout import HEAD, Prompt, bos, chunk_text, question_text, section_text
from kvfuse.text.tokenizer import Tokenizer

__all__ = ["CHAT_TEMPLATES", "DEFAULT_STOP", "HEAD", "ChatTemplate", "Completed", "Prompt", "TextDeltas",
           "Tokenizer", "bos", "chunk_text", "complete_answer", "complete_text", "question_text", "section_text",
           "stream_text"]
