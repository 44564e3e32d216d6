package http1

// States of the chunked-coding scanner (RFC 9112 §7.1):
//
//	chunked-body = *chunk last-chunk trailer-section CRLF
//	chunk        = chunk-size [ chunk-ext ] CRLF chunk-data CRLF
//	chunk-ext    = *( BWS ";" BWS ext-name [ BWS "=" BWS ( token / quoted-string ) ] )
const (
	csSize          uint8 = iota // first hex digit of a chunk-size
	csSizeMore                   // more hex digits, BWS, ';' or CR
	csSizeWS                     // BWS after the size: only ';' may follow
	csExtName0                   // after ';' and BWS: the extension name starts
	csExtName                    // in the name: BWS, '=', ';' or CR
	csExtNameWS                  // BWS after the name: '=' or ';'
	csExtVal0                    // after '=' and BWS: token or quoted-string
	csExtToken                   // in a token value: BWS, ';' or CR
	csExtQuoted                  // in a quoted-string
	csExtQuotedPair              // after '\' in a quoted-string
	csExtQuotedEnd               // after the closing '"': BWS, ';' or CR
	csExtValWS                   // BWS after a value: ';'
	csSizeLF                     // CR seen at the end of the size line
	csData                       // in chunk-data, remain bytes left
	csDataCR                     // CRLF after chunk-data
	csDataLF                     //
	csTrailer0                   // start of a trailer field line, or the final CRLF
	csTrailerName                // in a trailer field name
	csTrailerValue               // in a trailer field value
	csTrailerLF                  // CR seen at the end of a trailer line
	csEndLF                      // CR seen at the end of the body
	csDone                       // the body ended; nothing more is consumed
)

// chunker is the scanner shared by ChunkedDecoder and ChunkScanner. It stops at each run
// of chunk data so callers can copy it or look at it in place.
type chunker struct {
	state    uint8
	size     uint64 // chunk-size being read, then data bytes left in the chunk
	line     int    // bytes of the current size line, or of the trailer section so far
	total    int64  // payload bytes of the chunks begun so far (checked against maxBody)
	maxBody  int64  // -1: unlimited
	maxTrail int
}

func (c *chunker) reset(lim Limits) {
	*c = chunker{maxBody: lim.bodyBytes(), maxTrail: lim.headBytes()}
}

// next consumes src until it has scanned one run of chunk data, the body ends, or src is
// used up. data is the payload run (a sub-slice of src ending at src[n]); n counts every
// byte consumed, framing included.
func (c *chunker) next(src []byte) (n int, data []byte, err code) {
	p := 0
	for p < len(src) {
		b := src[p]
		switch c.state {
		case csData:
			k := len(src) - p
			if uint64(k) > c.size {
				k = int(c.size)
			}
			c.size -= uint64(k)
			if c.size == 0 {
				c.state = csDataCR
			}
			return p + k, src[p : p+k], cOK
		case csSize, csSizeMore:
			if class[b]&clHex != 0 {
				// At most 16 digits, leading zeros included (as net/http), so the
				// shift below never overflows.
				if c.line >= 16 {
					return p, nil, cBadChunk
				}
				c.size = c.size<<4 | uint64(hexVal(b))
				c.state = csSizeMore
				break
			}
			if c.state == csSize {
				return p, nil, cBadChunk
			}
			switch b {
			case '\r':
				c.state = csSizeLF
			case ';':
				c.state = csExtName0
			case ' ', '\t':
				c.state = csSizeWS
			default:
				return p, nil, cBadChunk
			}
		case csSizeWS, csExtNameWS, csExtValWS:
			switch {
			case isOWS(b):
			case b == ';':
				c.state = csExtName0
			case b == '=' && c.state == csExtNameWS:
				c.state = csExtVal0
			default:
				return p, nil, cBadChunk
			}
		case csExtName0:
			switch {
			case isOWS(b):
			case isTchar(b):
				c.state = csExtName
			default:
				return p, nil, cBadChunk
			}
		case csExtName, csExtToken:
			switch {
			case isTchar(b):
			case b == '\r':
				c.state = csSizeLF
			case b == ';':
				c.state = csExtName0
			case isOWS(b):
				if c.state == csExtName {
					c.state = csExtNameWS
				} else {
					c.state = csExtValWS
				}
			case b == '=' && c.state == csExtName:
				c.state = csExtVal0
			default:
				return p, nil, cBadChunk
			}
		case csExtVal0:
			switch {
			case isOWS(b):
			case isTchar(b):
				c.state = csExtToken
			case b == '"':
				c.state = csExtQuoted
			default:
				return p, nil, cBadChunk
			}
		case csExtQuoted:
			switch {
			case b == '"':
				c.state = csExtQuotedEnd
			case b == '\\':
				c.state = csExtQuotedPair
			case class[b]&clQdtext == 0:
				return p, nil, cBadChunk
			}
		case csExtQuotedEnd:
			switch {
			case b == '\r':
				c.state = csSizeLF
			case b == ';':
				c.state = csExtName0
			case isOWS(b):
				c.state = csExtValWS
			default:
				return p, nil, cBadChunk
			}
		case csExtQuotedPair:
			if class[b]&clValue == 0 {
				return p, nil, cBadChunk
			}
			c.state = csExtQuoted
		case csSizeLF:
			if b != '\n' {
				return p, nil, cBadChunk
			}
			c.line = 0
			if c.size == 0 {
				c.state = csTrailer0
				p++
				continue
			}
			if c.maxBody >= 0 && (c.size > uint64(c.maxBody) || c.total > c.maxBody-int64(c.size)) {
				return p, nil, cBodyTooLarge
			}
			if c.size > uint64(1<<63-1-c.total) {
				return p, nil, cBadChunk
			}
			c.total += int64(c.size)
			c.state = csData
			p++
			continue
		case csDataCR:
			if b != '\r' {
				return p, nil, cBadChunk
			}
			c.state = csDataLF
		case csDataLF:
			if b != '\n' {
				return p, nil, cBadChunk
			}
			c.state = csSize
			c.line = 0
			p++
			continue
		case csTrailer0:
			switch {
			case b == '\r':
				c.state = csEndLF
			case isTchar(b):
				c.state = csTrailerName
			default:
				return p, nil, cBadChunk
			}
		case csTrailerName:
			switch {
			case isTchar(b):
			case b == ':':
				c.state = csTrailerValue
			default:
				return p, nil, cBadChunk
			}
		case csTrailerValue:
			switch {
			case b == '\r':
				c.state = csTrailerLF
			case class[b]&clValue == 0:
				return p, nil, cBadChunk
			}
		case csTrailerLF:
			if b != '\n' {
				return p, nil, cBadChunk
			}
			c.state = csTrailer0
		case csEndLF:
			if b != '\n' {
				return p, nil, cBadChunk
			}
			c.state = csDone
			return p + 1, nil, cOK
		case csDone:
			return p, nil, cOK
		}
		// Every byte that reaches here belongs to a size line or the trailer section.
		c.line++
		if c.state >= csTrailer0 {
			if c.line > c.maxTrail {
				return p, nil, cTrailerTooLarge
			}
		} else if c.line > maxChunkLine {
			return p, nil, cBadChunk
		}
		p++
	}
	return p, nil, cOK
}

// payload returns the payload bytes consumed so far.
func (c *chunker) payload() int64 {
	if c.state == csData {
		return c.total - int64(c.size)
	}
	return c.total
}

func hexVal(b byte) byte {
	switch {
	case b <= '9':
		return b - '0'
	case b >= 'a':
		return b - 'a' + 10
	}
	return b - 'A' + 10
}

// ChunkedDecoder decodes a chunked request body incrementally: feed it the bytes after the
// head as they arrive, split anywhere, and it appends the payload to a caller-owned buffer.
// Chunk extensions are validated and dropped; trailer fields are validated and dropped.
// The zero value is not ready: call Reset before each body. A ChunkedDecoder lives in a
// per-connection struct and is not safe for concurrent use; it keeps no reference to the
// bytes it is given.
type ChunkedDecoder struct{ c chunker }

// Reset prepares d for a new body bounded by lim.MaxBodyBytes (payload bytes; exceeding it
// is ErrBodyTooLarge) with its trailer section bounded by lim.MaxHeadBytes.
func (d *ChunkedDecoder) Reset(lim Limits) { d.c.reset(lim) }

// Decode consumes chunked bytes from src and appends their payload to dst. It returns the
// extended dst, the number of bytes of src consumed (all of them unless the body ends
// inside src: the next pipelined request starts at src[n]), and done once the last chunk
// and trailer section have been consumed. Consumed bytes are never needed again, so the
// caller may Discard them and pass only the rest next time. Errors are ErrBadChunk,
// ErrBodyTooLarge and ErrTrailerTooLarge. Decode does not allocate unless dst must grow.
func (d *ChunkedDecoder) Decode(dst, src []byte) (out []byte, n int, done bool, err error) {
	for d.c.state != csDone {
		k, data, c := d.c.next(src[n:])
		n += k
		if c != cOK {
			return dst, n, false, c.req()
		}
		dst = append(dst, data...)
		if k == 0 || n == len(src) {
			break
		}
	}
	return dst, n, d.c.state == csDone, nil
}

// Next is the copy-free form of Decode: it consumes src up to and including the next run
// of payload bytes and returns that run as data, a sub-slice of src (valid as long as src
// is). Call it again with src[n:] until n == 0 or done.
func (d *ChunkedDecoder) Next(src []byte) (n int, data []byte, done bool, err error) {
	n, data, c := d.c.next(src)
	return n, data, d.c.state == csDone, c.req()
}

// Done reports whether the whole body has been consumed.
func (d *ChunkedDecoder) Done() bool { return d.c.state == csDone }

// Len returns the payload bytes decoded so far.
func (d *ChunkedDecoder) Len() int64 { return d.c.payload() }

// ChunkScanner follows a chunked upstream response that the proxy forwards unchanged: it
// tells how many raw bytes belong to the body, where the body ends, and what the payload
// is (the SSE stream the proxy reads metrics from). It validates like ChunkedDecoder but
// reports response errors (ErrBadResponseChunk, ErrResponseTooLarge, all 502). Call Reset
// before each response. A ChunkScanner lives in a per-upstream-connection struct and is not
// safe for concurrent use; it keeps no reference to the bytes it is given.
type ChunkScanner struct{ c chunker }

// Reset prepares s for a new response body. A negative lim.MaxBodyBytes streams bodies of
// any size; 0 means the 32 MiB default.
func (s *ChunkScanner) Reset(lim Limits) { s.c.reset(lim) }

// Scan consumes raw body bytes from src and appends the payload of the chunk data among
// them to dst. n is the number of raw bytes of src that belong to the body (forward
// src[:n] to the client as is); n < len(src) only when the body ended inside src. done
// reports that the last chunk and trailer section are complete. Scan does not allocate
// unless dst must grow; with a nil dst it only frames.
func (s *ChunkScanner) Scan(dst, src []byte) (out []byte, n int, done bool, err error) {
	for s.c.state != csDone {
		k, data, c := s.c.next(src[n:])
		n += k
		if c != cOK {
			return dst, n, false, c.resp()
		}
		if dst != nil {
			dst = append(dst, data...)
		}
		if k == 0 || n == len(src) {
			break
		}
	}
	return dst, n, s.c.state == csDone, nil
}

// Next is the copy-free form of Scan: it consumes src up to and including the next run of
// payload bytes and returns that run as data, a sub-slice of src. Call it again with
// src[n:] until n == 0 or done; the sum of the n values is the body's raw byte count.
func (s *ChunkScanner) Next(src []byte) (n int, data []byte, done bool, err error) {
	n, data, c := s.c.next(src)
	return n, data, s.c.state == csDone, c.resp()
}

// Done reports whether the whole body has been scanned.
func (s *ChunkScanner) Done() bool { return s.c.state == csDone }

// Len returns the payload bytes scanned so far.
func (s *ChunkScanner) Len() int64 { return s.c.payload() }
