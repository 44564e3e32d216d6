package tokenizer

// AppendEncodeLimit is t.AppendEncode that gives up once the text is known to take more than
// limit ids: it then returns false, and dst holds some of the ids. It encodes the text a
// segment (the run between special tokens) or, where the pre-tokenizer allows, a safe chunk
// at a time (see cutAfter), checking the count after each, so a prompt far longer than a
// model's context costs about limit ids of work; a text whose byte length alone proves it
// too long (more than limit times the longest token's bytes) costs none. limit ≤ 0 means
// no limit. The ids, when it returns true, are exactly t.AppendEncode's.
func AppendEncodeLimit(t Tokenizer, dst []uint32, text string, limit int) ([]uint32, bool) {
	if limit <= 0 {
		return t.AppendEncode(dst, text), true
	}
	var c *SegmentCache
	b, _ := t.(*bpeTokenizer)
	if sc, ok := t.(*SegmentCache); ok {
		c, b = sc, sc.bpe
	}
	start := len(dst)
	if b == nil {
		dst = t.AppendEncode(dst, text)
		return dst, len(dst)-start <= limit
	}
	if mb := b.maxTokenBytes(); mb > 0 && len(text) > limit*mb {
		return dst, false
	}
	over := func() bool { return len(dst)-start > limit }
	chunked := b.newlineSafe()
	for pos := 0; pos < len(text); {
		s, e, tok, ok := b.added.find(text, pos)
		if !ok {
			s, e = len(text), len(text)
		}
		seg := text[pos:s]
		for from := 0; from < len(seg); {
			end := len(seg)
			if chunked && len(seg) >= 2*chunkBytes {
				end = cutAfter(seg, from+chunkBytes)
			}
			if c != nil {
				dst = c.cached(dst, seg[from:end])
			} else {
				dst = b.encodeOrdinary(dst, seg[from:end], nil)
			}
			if over() {
				return dst, false
			}
			from = end
		}
		if ok {
			dst = append(dst, tok.id)
		}
		pos = e
	}
	return dst, !over()
}

// maxTokenBytes is the most bytes of text one id stands for; 0 (unknown) for tokenizers
// whose added tokens may strip white space around them or whose normaliser may change the
// text's length, where no such bound holds.
func (t *bpeTokenizer) maxTokenBytes() int { return t.maxBytes }

// longestToken is the most bytes of any token or added token of t.
func longestToken(t *bpeTokenizer) int {
	m := 0
	for i := 1; i < len(t.v.offs); i++ {
		m = max(m, int(t.v.offs[i]-t.v.offs[i-1]))
	}
	for _, s := range t.addedText {
		m = max(m, len(s))
	}
	return m
}
