"""A tiny knowledge base for tests: two groups, a leads-only document, shared and private documents."""

import json

DOCS = [  # id, stability, groups, shared, text
    ("plans", 1, ["support", "leads"], True, "Team plan: 30 days to return an annual charge."),
    ("billing", 2, ["support", "leads"], False, "Invoices are issued on the first day."),
    ("margins", 2, ["leads"], False, "Secret margin: at most 22 percent off."),
    ("faq", 5, ["support", "leads"], False, "As a rule, refunds within 14 days."),
]


def write_kb(root, docs=DOCS, order=None) -> None:  # type: ignore[no-untyped-def]
    (root / "docs").mkdir(parents=True, exist_ok=True)
    lines = ['name = "demo"', 'instructions = "Answer from the policies."', ""]
    for i in order or range(len(docs)):
        doc_id, st, groups, shared, text = docs[i]
        (root / "docs" / f"{doc_id}.md").write_text(text + "\n")
        lines += ["[[documents]]", f'id = "{doc_id}"', f'title = "{doc_id.title()}"', f'path = "docs/{doc_id}.md"',
                  f"stability = {st}", f"groups = {json.dumps(groups)}", f"shared = {str(shared).lower()}", ""]
    (root / "kb.toml").write_text("\n".join(lines))
