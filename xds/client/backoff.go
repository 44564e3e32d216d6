package client

import (
	"math/rand/v2"
	"time"
)

// backoff yields jittered exponential waits: the n-th wait is drawn uniformly from
// [d/2, d] with d = base·2ⁿ capped at max, so proxies that lost the same control plane
// do not all come back at once. Owned by one goroutine.
type backoff struct {
	base, max time.Duration
	cur       time.Duration
}

func newBackoff(base, max time.Duration) *backoff {
	return &backoff{base: base, max: max, cur: base}
}

func (b *backoff) next() time.Duration {
	d := b.cur
	b.cur = min(2*b.cur, b.max)
	half := d / 2
	return half + rand.N(half+1)
}

func (b *backoff) reset() { b.cur = b.base }
