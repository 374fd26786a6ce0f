"""CAG knowledge bases: a manifest of documents, a deterministic prefix per access group, cached once
and answered from; costs, quotes, and the hybrid with retrieved chunks fused by blend."""
