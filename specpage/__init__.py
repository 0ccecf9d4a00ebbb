"""specpage: a speculative-decoding serving daemon over one paged KV block pool."""
