package decide

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Retry-After follows the queue's drain rate: the time to drain as many requests as wait,
// plus one, at the recent gap between departures; a second without a recent rate; never
// past a minute.
func TestQueueRetryAfterFollowsDrainRate(t *testing.T) {
	q := newAdmissionQueue(16, newMetrics(prometheus.NewRegistry()))
	now := nanotime()
	if got := q.retryAfter(now); got != 1 {
		t.Fatalf("without a drain rate: %d", got)
	}
	for range 3 {
		q.items = append(q.items, &QueueItem{})
	}
	q.gap, q.lastOut = 2e9, now // one departure every 2 s
	if got := q.retryAfter(now); got != 8 {
		t.Fatalf("3 waiting, 2 s apart: %d, want 8", got)
	}
	q.gap = 90e9
	if got := q.retryAfter(now); got != 60 {
		t.Fatalf("a slow queue: %d, want the 60 s bound", got)
	}
	if got := q.retryAfter(now + int64(time.Minute)); got != 1 {
		t.Fatalf("a rate a minute old: %d, want 1", got)
	}
}
