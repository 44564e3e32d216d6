package http1

// Defaults for Limits fields left at zero.
const (
	DefaultMaxHeadBytes = 64 << 10
	DefaultMaxBodyBytes = 32 << 20
	DefaultMaxHeaders   = MaxHeaderCount
)

// MaxHeaderCount is the capacity of a HeaderList and so the largest usable
// Limits.MaxHeaders.
const MaxHeaderCount = 100

// maxChunkLine bounds the bytes of one chunk-size line (size and extensions), so a peer
// cannot make the proxy scan unbounded extension bytes per chunk.
const maxChunkLine = 4096

// Limits bounds what a peer may send. The zero value means the defaults; a Limits is a plain
// value, copied into parsers, and safe to share.
type Limits struct {
	// MaxHeadBytes bounds the request or status line plus header fields, final CRLF
	// included; a chunked trailer section is bounded by it too. 0 means 64 KiB. A head
	// still incomplete when the buffer reaches this size is ErrHeadTooLarge (431).
	MaxHeadBytes int
	// MaxBodyBytes bounds the decoded body: a larger Content-Length fails at the head,
	// chunked bodies fail at the chunk that crosses it. 0 means 32 MiB, negative means no
	// limit (for streamed upstream responses).
	MaxBodyBytes int64
	// MaxHeaders bounds the number of header field lines. 0 means, and values above
	// MaxHeaderCount are capped to, MaxHeaderCount (100).
	MaxHeaders int
}

// DefaultLimits returns the limits the zero value stands for, spelled out.
func DefaultLimits() Limits {
	return Limits{MaxHeadBytes: DefaultMaxHeadBytes, MaxBodyBytes: DefaultMaxBodyBytes, MaxHeaders: DefaultMaxHeaders}
}

func (l Limits) headBytes() int {
	if l.MaxHeadBytes <= 0 {
		return DefaultMaxHeadBytes
	}
	return l.MaxHeadBytes
}

// bodyBytes returns the body limit, -1 for none.
func (l Limits) bodyBytes() int64 {
	switch {
	case l.MaxBodyBytes == 0:
		return DefaultMaxBodyBytes
	case l.MaxBodyBytes < 0:
		return -1
	}
	return l.MaxBodyBytes
}

func (l Limits) headers() int {
	if l.MaxHeaders <= 0 || l.MaxHeaders > MaxHeaderCount {
		return MaxHeaderCount
	}
	return l.MaxHeaders
}
