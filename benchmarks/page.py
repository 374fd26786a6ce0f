"""Issue J: the web page in a real headless Chromium against `kvfuse serve --kb albaran` (default model).

Measures, over --rounds rounds:
- page load: navigation start to the sign-in form, on loopback (target: under 1 s);
- time to the first streamed character in the browser, against the server's TTFT for the same
  request (`kvfuse.ttft_s`, the engine's, and `kvfuse.client_ttft_s`, from the request's arrival);
- usability while a request decodes: with an answer streaming, how long the Documents tab takes to
  list the knowledge base's documents.

    python benchmarks/page.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

QUESTIONS = [
    "How many days does a Team plan customer have to ask for a refund on an annual renewal?",
    "How much does the Team plan cost per month?",
    "How long is the free trial?",
    "How many seats does the Business plan include?",
    "How long does a Team workspace stay read-only after its subscription ends?",
]


def main() -> None:
    from playwright.sync_api import sync_playwright

    from kvfuse.server.process import serve_process

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--store", default=None)
    args = p.parse_args()
    serve = ["--kb", "albaran", "--log-level", "warning"] + (["--store", args.store] if args.store else [])
    loads: list[float] = []
    rows: list[dict[str, Any]] = []
    docs_while_decoding: list[float] = []
    with serve_process(serve) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        warm = browser.new_page()  # the prefix is built (or loaded) once, before anything is timed
        warm.goto(url + "/")
        warm.fill("#key", "any")
        warm.click("#signin-form button")
        warm.fill("#question", "Hello")
        warm.click("#ask")
        warm.wait_for_selector(".turn .meta:has-text('TTFT')", timeout=600_000)
        warm.close()
        for r in range(args.rounds):
            page = browser.new_page()
            t0 = time.perf_counter()
            page.goto(url + "/")
            page.wait_for_selector("#signin-form")
            loads.append(time.perf_counter() - t0)
            page.fill("#key", "any")
            page.click("#signin-form button")
            page.wait_for_selector("#app:not([hidden])")
            q = QUESTIONS[r % len(QUESTIONS)]
            page.fill("#question", q)
            page.click("#ask")
            page.wait_for_selector(".turn .answer:not(:empty)", timeout=120_000)
            t1 = time.perf_counter()  # an answer is streaming: is the page still usable?
            page.click(".tab[data-tab=docs]")
            page.wait_for_selector("#doc-list tr.doc")
            docs_while_decoding.append(time.perf_counter() - t1)
            page.click(".tab[data-tab=ask]")
            page.wait_for_selector(".turn .meta:has-text('TTFT')", timeout=120_000)
            turn = page.locator(".turn").first
            rows.append({"question": q, "first_char_s": float(turn.get_attribute("data-first-char-ms")) / 1000,
                         "server_ttft_s": float(turn.get_attribute("data-ttft-s")),
                         "client_ttft_s": float(turn.get_attribute("data-client-ttft-s"))})
            print(f"round {r + 1}: load {loads[-1]:.3f}s, first char {rows[-1]['first_char_s']:.3f}s, "
                  f"server TTFT {rows[-1]['server_ttft_s']:.3f}s (client {rows[-1]['client_ttft_s']:.3f}s), "
                  f"documents while decoding {docs_while_decoding[-1]:.3f}s", flush=True)
            page.close()
        browser.close()
    med = statistics.median
    print(json.dumps({
        "rounds": args.rounds, "page_load_s_median": round(med(loads), 4), "page_load_s_max": round(max(loads), 4),
        "first_char_s_median": round(med(r["first_char_s"] for r in rows), 4),
        "server_ttft_s_median": round(med(r["server_ttft_s"] for r in rows), 4),
        "client_ttft_s_median": round(med(r["client_ttft_s"] for r in rows), 4),
        "first_char_minus_client_ttft_s_median": round(med(r["first_char_s"] - r["client_ttft_s"] for r in rows), 4),
        "documents_tab_while_decoding_s_median": round(med(docs_while_decoding), 4),
    }, indent=1))


if __name__ == "__main__":
    main()
