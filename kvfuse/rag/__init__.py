"""Retrieval: token-based chunking, BM25, dense (all-MiniLM-L6-v2) and hybrid (RRF) retrievers, a disk index."""
