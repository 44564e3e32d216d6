package workload

import "fmt"

// exactText returns prefix followed by words from r such that the whole tokenizes to exactly
// n tokens. A prefix longer than n tokens is cut to its first n tokens. Words only ever add one
// token each after a prefix ending in a letter, punctuation or a newline, so the first try
// nearly always fits; otherwise the word count is corrected from the measured length. r
// advances by the words of the text returned, so the result is deterministic in r's state.
func exactText(tok Tokenizer, v *vocab, r *rng, prefix string, n int) (string, error) {
	if prefix == "" {
		return v.text(r, n), nil
	}
	ids := tok.Encode(prefix)
	for m := n; len(ids) > n; m-- {
		if m < 0 {
			return "", fmt.Errorf("%w: cannot cut text to %d tokens", ErrTokenizer, n)
		}
		prefix = tok.Decode(ids[:m])
		ids = tok.Encode(prefix)
	}
	k := n - len(ids)
	for range 8 {
		rr := *r
		b := append(make([]byte, 0, len(prefix)+6*k), prefix...)
		s := string(v.appendWords(b, &rr, k))
		got := len(tok.Encode(s))
		if got == n {
			*r = rr
			return s, nil
		}
		k += n - got
		if k < 0 {
			break
		}
	}
	return "", fmt.Errorf("%w: cannot build text of %d tokens after %q", ErrTokenizer, n, prefix)
}

// cutTokens drops the first n tokens of text: an answer's reasoning, which clients do not send
// back.
func cutTokens(tok Tokenizer, text string, n int) string {
	if n <= 0 || text == "" {
		return text
	}
	ids := tok.Encode(text)
	if len(ids) <= n {
		return ""
	}
	return tok.Decode(ids[n:])
}
