package http1

import (
	"errors"
	"strings"
	"testing"
	"unsafe"
)

var chunkedCases = []struct {
	name    string
	in      string // a chunked body; anything after its end must be left unconsumed
	lim     Limits
	payload string
	err     error // request-side error; the scanner maps it to a 502 sentinel
}{
	{name: "empty body", in: "0\r\n\r\n", payload: ""},
	{name: "one chunk", in: "5\r\nhello\r\n0\r\n\r\n", payload: "hello"},
	{name: "many chunks", in: "1\r\na\r\n2\r\nbc\r\n3\r\ndef\r\n0\r\n\r\n", payload: "abcdef"},
	{name: "hex sizes", in: "A\r\n0123456789\r\n00000010\r\nabcdefghijklmnop\r\n0\r\n\r\n", payload: "0123456789abcdefghijklmnop"},
	{name: "data with crlf inside", in: "4\r\n\r\n\r\n\r\n0\r\n\r\n", payload: "\r\n\r\n"},
	{name: "pipelined after", in: "2\r\nok\r\n0\r\n\r\nGET / HTTP/1.1\r\n", payload: "ok"},
	{name: "sixteen digits", in: "0000000000000005\r\nhello\r\n0000000000000000\r\n\r\n", payload: "hello"},
	{name: "zeros last chunk", in: "2\r\nok\r\n000\r\n\r\n", payload: "ok"},
	{name: "extension name", in: "2;foo\r\nok\r\n0\r\n\r\n", payload: "ok"},
	{name: "extension token value", in: "2;foo=bar;baz\r\nok\r\n0;last\r\n\r\n", payload: "ok"},
	{name: "extension quoted value", in: "2;a=\"x; \\\"y\\\" z\"\r\nok\r\n0\r\n\r\n", payload: "ok"},
	{name: "extension with bws", in: "2 ; a = b ; c = \"d\"\r\nok\r\n0\r\n\r\n", payload: "ok"},
	{name: "trailers", in: "2\r\nok\r\n0\r\nX-Usage: 12\r\nServer-Timing: ttft;dur=12.5\r\n\r\n", payload: "ok"},
	{name: "empty trailer value", in: "0\r\nX:\r\n\r\n", payload: ""},
	{name: "body at limit", in: "5\r\nhello\r\n0\r\n\r\n", lim: Limits{MaxBodyBytes: 5}, payload: "hello"},

	{name: "empty size", in: "\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "non-hex size", in: "g\r\n", err: ErrBadChunk},
	{name: "0x prefix", in: "0x5\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "negative size", in: "-5\r\nhello\r\n", err: ErrBadChunk},
	{name: "plus size", in: "+5\r\nhello\r\n", err: ErrBadChunk},
	{name: "overflowing size", in: "10000000000000000\r\n", lim: Limits{MaxBodyBytes: -1}, err: ErrBadChunk},
	{name: "seventeen digits", in: "00000000000000005\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "size overflows int64", in: "8000000000000000\r\n", lim: Limits{MaxBodyBytes: -1}, err: ErrBadChunk},
	{name: "bare lf after size", in: "5\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "cr without lf after size", in: "5\rhello\r\n", err: ErrBadChunk},
	{name: "space after size", in: "5 \r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "data longer than size", in: "3\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "bare lf after data", in: "5\r\nhello\n0\r\n\r\n", err: ErrBadChunk},
	{name: "missing crlf after data", in: "5\r\nhello0\r\n\r\n", err: ErrBadChunk},
	{name: "lf in extension", in: "5;a\nb\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "empty extension name", in: "5;=b\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "extension without value", in: "5;a=\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "extension bad char", in: "5;a@b\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "extension trailing space", in: "5;a \r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "extension value trailing space", in: "5;a=b \r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "text after quoted value", in: "5;a=\"b\"c\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "cr in quoted value", in: "5;a=\"b\r\n\"\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "control in quoted pair", in: "5;a=\"\\\x01\"\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "long extension", in: "5;a=" + strings.Repeat("x", 5000) + "\r\nhello\r\n0\r\n\r\n", err: ErrBadChunk},
	{name: "trailer obs-fold", in: "0\r\nX: a\r\n b\r\n\r\n", err: ErrBadChunk},
	{name: "trailer without colon", in: "0\r\nX\r\n\r\n", err: ErrBadChunk},
	{name: "trailer space before colon", in: "0\r\nX : a\r\n\r\n", err: ErrBadChunk},
	{name: "trailer bare lf", in: "0\r\nX: a\n\r\n", err: ErrBadChunk},
	{name: "trailer control char", in: "0\r\nX: a\x00\r\n\r\n", err: ErrBadChunk},
	{name: "bare lf at end", in: "0\r\n\n", err: ErrBadChunk},
	{name: "cr then junk at end", in: "0\r\n\rx", err: ErrBadChunk},
	{name: "body over limit", in: "5\r\nhello\r\n1\r\n!\r\n0\r\n\r\n", lim: Limits{MaxBodyBytes: 5}, err: ErrBodyTooLarge},
	{name: "huge chunk over default limit", in: "2000001\r\n", err: ErrBodyTooLarge},
	{name: "trailers over limit", in: "0\r\nX-Pad: " + strings.Repeat("p", 100) + "\r\n\r\n", lim: Limits{MaxHeadBytes: 64}, err: ErrTrailerTooLarge},
}

func TestChunkedDecoder(t *testing.T) {
	for _, tt := range chunkedCases {
		t.Run(tt.name, func(t *testing.T) {
			var d ChunkedDecoder
			d.Reset(tt.lim)
			out, n, done, err := d.Decode(nil, []byte(tt.in))
			if !errors.Is(err, tt.err) {
				t.Fatalf("err = %v, want %v", err, tt.err)
			}
			if err != nil {
				if done {
					t.Error("done with an error")
				}
				return
			}
			if !done || string(out) != tt.payload {
				t.Fatalf("payload %q done %v, want %q true", out, done, tt.payload)
			}
			if want := chunkedEnd(tt.in); n != want {
				t.Errorf("consumed %d, want %d", n, want)
			}
			if d.Len() != int64(len(tt.payload)) || !d.Done() {
				t.Errorf("Len %d Done %v", d.Len(), d.Done())
			}
			// Once done, nothing more is consumed.
			if _, m, done, err := d.Decode(nil, []byte("more")); m != 0 || !done || err != nil {
				t.Errorf("after the end: consumed %d done %v err %v", m, done, err)
			}
		})
	}
}

// chunkedEnd finds where a valid chunked body ends with a plain reference scanner.
func chunkedEnd(in string) int {
	p := 0
	for {
		i := strings.Index(in[p:], "\r\n")
		line := in[p : p+i]
		if j := strings.IndexByte(line, ';'); j >= 0 {
			line = line[:j]
		}
		line = strings.TrimRight(line, " \t")
		var size int
		for _, c := range line {
			size = size*16 + int(hexVal(byte(c)))
		}
		p += i + 2
		if size == 0 {
			break
		}
		p += size + 2
	}
	for {
		i := strings.Index(in[p:], "\r\n")
		p += i + 2
		if i == 0 {
			return p
		}
	}
}

func TestChunkScanner(t *testing.T) {
	for _, tt := range chunkedCases {
		t.Run(tt.name, func(t *testing.T) {
			var s ChunkScanner
			s.Reset(tt.lim)
			out, n, done, err := s.Scan([]byte{}, []byte(tt.in))
			if tt.err != nil {
				want := errs[codeOf(tt.err)].resp
				if !errors.Is(err, want) {
					t.Fatalf("err = %v, want %v", err, want)
				}
				return
			}
			if err != nil || !done || string(out) != tt.payload {
				t.Fatalf("payload %q done %v err %v, want %q", out, done, err, tt.payload)
			}
			if want := chunkedEnd(tt.in); n != want {
				t.Errorf("raw body bytes %d, want %d", n, want)
			}
			// Framing only: a nil dst stays nil.
			s.Reset(tt.lim)
			if out, n2, done, err := s.Scan(nil, []byte(tt.in)); out != nil || n2 != n || !done || err != nil {
				t.Errorf("nil dst: %q %d %v %v", out, n2, done, err)
			}
			// Copy-free: the data runs are sub-slices of the input and add up to the payload.
			s.Reset(tt.lim)
			src := []byte(tt.in)
			var got []byte
			total := 0
			for {
				k, data, done, err := s.Next(src[total:])
				if err != nil {
					t.Fatal(err)
				}
				if len(data) > 0 && !within(data, src) {
					t.Fatal("Next returned data outside src")
				}
				got = append(got, data...)
				total += k
				if done || k == 0 {
					break
				}
			}
			if string(got) != tt.payload || total != n {
				t.Errorf("Next: payload %q raw %d, want %q %d", got, total, tt.payload, n)
			}
		})
	}
}

func codeOf(e error) code {
	for c := cOK + 1; c < numCodes; c++ {
		if errs[c].req == e {
			return c
		}
	}
	panic("no code for " + e.Error())
}

func within(sub, buf []byte) bool {
	s := uintptr(unsafe.Pointer(unsafe.SliceData(sub)))
	b := uintptr(unsafe.Pointer(unsafe.SliceData(buf)))
	return s >= b && s+uintptr(len(sub)) <= b+uintptr(len(buf))
}

// TestChunkedEverySplit decodes each valid case split in two at every point, and one byte
// at a time, discarding consumed bytes as the proxy does; the results never change.
func TestChunkedEverySplit(t *testing.T) {
	for _, tt := range chunkedCases {
		if tt.err != nil {
			continue
		}
		t.Run(tt.name, func(t *testing.T) {
			want := chunkedEnd(tt.in)
			for split := 0; split <= len(tt.in); split++ {
				out, n, err := decodeInReads(tt.in, tt.lim, split, len(tt.in))
				if err != nil || string(out) != tt.payload || n != want {
					t.Fatalf("split %d: %q %d %v, want %q %d", split, out, n, err, tt.payload, want)
				}
			}
			out, n, err := decodeInReads(tt.in, tt.lim, 1, 1)
			if err != nil || string(out) != tt.payload || n != want {
				t.Fatalf("byte by byte: %q %d %v, want %q %d", out, n, err, tt.payload, want)
			}
		})
	}
	for _, tt := range chunkedCases {
		if tt.err == nil {
			continue
		}
		t.Run(tt.name, func(t *testing.T) {
			if _, _, err := decodeInReads(tt.in, tt.lim, 1, 1); !errors.Is(err, tt.err) {
				t.Fatalf("byte by byte: err %v, want %v", err, tt.err)
			}
		})
	}
}

// decodeInReads delivers in as a first read of first bytes and then reads of step bytes.
// Unconsumed bytes stay buffered, as in gnet's inbound buffer.
func decodeInReads(in string, lim Limits, first, step int) (out []byte, consumed int, err error) {
	var d ChunkedDecoder
	d.Reset(lim)
	var pending []byte
	off := 0
	for next := first; ; next = step {
		end := min(off+next, len(in))
		pending = append(pending, in[off:end]...)
		off = end
		var n int
		var done bool
		out, n, done, err = d.Decode(out, pending)
		consumed += n
		pending = pending[n:]
		if err != nil || done {
			return out, consumed, err
		}
		if off == len(in) {
			return out, consumed, ErrBadChunk // truncated
		}
	}
}
