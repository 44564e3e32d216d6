package clock

import (
	"testing"
	"time"
)

func TestNowAndMonoAgree(t *testing.T) {
	m0 := Mono()
	n := Now()
	m1 := Mono()
	if m := MonoAt(n); m < m0 || m > m1 {
		t.Fatalf("MonoAt(Now()) = %d, want between %d and %d", m, m0, m1)
	}
	if d := time.Duration(n - time.Now().UnixNano()); d < -time.Second || d > time.Second {
		t.Fatalf("Now is %v off the wall clock", d)
	}
	time.Sleep(2 * time.Millisecond)
	if m2 := Mono(); m2-m1 < int64(2*time.Millisecond) {
		t.Fatalf("Mono advanced %d ns over a 2 ms sleep", m2-m1)
	}
}
