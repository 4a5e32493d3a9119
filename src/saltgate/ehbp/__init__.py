"""EHBP (Encrypted HTTP Body Protocol): pure framing, HPKE contexts and response keys."""
