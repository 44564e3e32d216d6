package xds

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"google.golang.org/protobuf/types/known/anypb"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// LoadsType is the type URL of xdsv1.Loads: the workers' loads in shards of LoadsShard,
// each named LoadsName(shard).
const LoadsType = "type.googleapis.com/kvrelay.xds.v1.Loads"

const (
	// LoadsShard is how many load indexes one Loads resource covers. A shard is resent
	// whole when any of its loads moves, so a smaller one sends less where a few loads move
	// in each push (3,000 workers, 10 proxies in bench-xds scale: 152 KB/s a proxy at 32,
	// 186 KB/s at 128, 165 KB/s with each load in its Worker resource) and a larger one
	// less framing where most do. At 32 a shard of busy workers is about 580 bytes, and
	// 10,000 workers are 313 resources for the control plane's cache to compare per proxy.
	LoadsShard = 32
	// MaxLoadIndex bounds Worker.load_index (a million workers).
	MaxLoadIndex = 1 << 20
	// kvUnit is Loads.kv_usage's unit: 1/65536 of the KV cache.
	kvUnit = 1 << 16
	// msNanos is Loads.observed_back_ms's unit in nanoseconds.
	msNanos = 1_000_000
)

// loadsPrefix starts every Loads resource name.
const loadsPrefix = "loads/"

// LoadsName is the resource name of the Loads of shard.
func LoadsName(shard uint32) string { return loadsPrefix + strconv.FormatUint(uint64(shard), 10) }

// ParseLoadsName returns the shard a Loads resource name names.
func ParseLoadsName(name string) (uint32, error) {
	rest, ok := strings.CutPrefix(name, loadsPrefix)
	if !ok {
		return 0, fmt.Errorf("%w: loads resource named %q, want %s<shard>", ErrInvalid, name, loadsPrefix)
	}
	n, err := strconv.ParseUint(rest, 10, 32)
	if err != nil || n >= MaxLoadIndex/LoadsShard || strconv.FormatUint(n, 10) != rest {
		return 0, fmt.Errorf("%w: loads resource named %q: shard not a number below %d in canonical form", ErrInvalid, name, MaxLoadIndex/LoadsShard)
	}
	return uint32(n), nil
}

// IDCheck is the check a Loads entry carries of its worker's id: FNV-1a, 32 bits.
func IDCheck(id string) uint32 {
	h := uint32(2166136261)
	for i := range len(id) {
		h = (h ^ uint32(id[i])) * 16777619
	}
	return h
}

// IndexedLoad is a worker's load at its load index (Worker.load_index), with its id.
type IndexedLoad struct {
	Index uint32
	ID    string
	Load  *xdsv1.Load
}

// PackLoads encodes the loads of one shard as a Loads resource. ls must be in ascending
// index order, every index in the shard, once; a nil Load is packed as zero (the server
// leaves a worker without a load out of its shard instead). Load.reports
// does not travel (proxies of control planes that push Loads take their share from the
// epoch), and observed_unix_nano is kept to the millisecond.
func PackLoads(shard uint32, ls []IndexedLoad) (*xdsv1.Loads, error) {
	if shard >= MaxLoadIndex/LoadsShard {
		return nil, fmt.Errorf("packing the loads of shard %d: shards end at %d", shard, MaxLoadIndex/LoadsShard)
	}
	n := len(ls)
	out := &xdsv1.Loads{
		IndexDelta: make([]uint32, n), Running: make([]uint32, n), Waiting: make([]uint32, n), KvUsage: make([]uint32, n),
		Inflight: make([]uint32, n), PrefillTokens: make([]uint64, n), DecodeBlocks: make([]uint64, n),
		EpochBack: make([]uint64, n), ObservedBackMs: make([]uint64, n), IdCheck: make([]uint32, n),
	}
	first := shard * LoadsShard
	prev := first
	for i, e := range ls {
		if e.Index < first || e.Index >= first+LoadsShard || i > 0 && e.Index <= prev {
			return nil, fmt.Errorf("packing the loads of shard %d: index %d out of order or outside the shard", shard, e.Index)
		}
		out.IndexDelta[i], prev = e.Index-prev, e.Index
		out.IdCheck[i] = IDCheck(e.ID)
		out.EpochBase = max(out.EpochBase, e.Load.GetEpoch())
		out.ObservedBaseUnixNano = max(out.ObservedBaseUnixNano, e.Load.GetObservedUnixNano())
	}
	for i, e := range ls {
		l := e.Load
		out.Running[i], out.Waiting[i], out.Inflight[i] = l.GetRunning(), l.GetWaiting(), l.GetInflight()
		out.PrefillTokens[i], out.DecodeBlocks[i] = l.GetPrefillTokens(), l.GetDecodeBlocks()
		if u := l.GetKvUsage(); u > 0 { // NaN stays 0
			out.KvUsage[i] = uint32(math.Round(min(u, 1) * kvUnit))
		}
		if ep := l.GetEpoch(); ep != 0 {
			out.EpochBack[i] = out.EpochBase - ep + 1
		}
		if o := l.GetObservedUnixNano(); o > 0 {
			out.ObservedBackMs[i] = uint64((out.ObservedBaseUnixNano-o)/msNanos) + 1
		}
	}
	return out, nil
}

// Shard is a Loads resource unpacked: entry i of Loads is the load at index
// shard·LoadsShard + i (nil where the shard has none), and entry i of Checks the IDCheck
// of its worker's id. Neither is modified once built.
type Shard struct {
	Loads  []*xdsv1.Load
	Checks []uint32
}

// UnpackLoads decodes and checks the Loads of shard. It never panics on arbitrary input;
// every error wraps ErrInvalid.
func UnpackLoads(shard uint32, l *xdsv1.Loads) (Shard, error) {
	n := len(l.GetIndexDelta())
	if n > LoadsShard {
		return Shard{}, fmt.Errorf("%w: loads shard %d: %d entries, above %d", ErrInvalid, shard, n, LoadsShard)
	}
	for _, c := range []int{len(l.GetRunning()), len(l.GetWaiting()), len(l.GetKvUsage()), len(l.GetInflight()),
		len(l.GetPrefillTokens()), len(l.GetDecodeBlocks()), len(l.GetEpochBack()), len(l.GetObservedBackMs()), len(l.GetIdCheck())} {
		if c != n {
			return Shard{}, fmt.Errorf("%w: loads shard %d: columns of %d and %d entries", ErrInvalid, shard, n, c)
		}
	}
	if l.GetObservedBaseUnixNano() < 0 {
		return Shard{}, fmt.Errorf("%w: loads shard %d observed at negative time %d", ErrInvalid, shard, l.GetObservedBaseUnixNano())
	}
	out := Shard{Loads: make([]*xdsv1.Load, LoadsShard), Checks: make([]uint32, LoadsShard)}
	at := uint64(0)
	for i, d := range l.GetIndexDelta() {
		next := uint64(d)
		if i > 0 {
			next += at
		}
		if i > 0 && d == 0 || next >= LoadsShard {
			return Shard{}, fmt.Errorf("%w: loads shard %d: entry %d's index repeats or leaves the shard", ErrInvalid, shard, i)
		}
		at = next
		kv := l.GetKvUsage()[i]
		if kv > kvUnit {
			return Shard{}, fmt.Errorf("%w: loads shard %d: entry %d's kv usage %d/%d above 1", ErrInvalid, shard, i, kv, kvUnit)
		}
		load := &xdsv1.Load{Running: l.GetRunning()[i], Waiting: l.GetWaiting()[i], KvUsage: float64(kv) / kvUnit, Inflight: l.GetInflight()[i],
			PrefillTokens: l.GetPrefillTokens()[i], DecodeBlocks: l.GetDecodeBlocks()[i]}
		if b := l.GetEpochBack()[i]; b != 0 {
			if b-1 >= l.GetEpochBase() {
				return Shard{}, fmt.Errorf("%w: loads shard %d: entry %d's epoch %d back from %d", ErrInvalid, shard, i, b-1, l.GetEpochBase())
			}
			load.Epoch = l.GetEpochBase() - (b - 1)
		}
		if b := l.GetObservedBackMs()[i]; b != 0 {
			if b-1 > math.MaxInt64/msNanos || int64(b-1)*msNanos > l.GetObservedBaseUnixNano() {
				return Shard{}, fmt.Errorf("%w: loads shard %d: entry %d observed %d ms before %d", ErrInvalid, shard, i, b-1, l.GetObservedBaseUnixNano())
			}
			load.ObservedUnixNano = l.GetObservedBaseUnixNano() - int64(b-1)*msNanos
		}
		out.Loads[at], out.Checks[at] = load, l.GetIdCheck()[i]
	}
	return out, nil
}

// DecodeLoads unmarshals and checks a Loads resource received under name, returning its
// shard number and the shard as UnpackLoads does. It never panics on arbitrary input;
// every error wraps ErrInvalid.
func DecodeLoads(name string, res *anypb.Any) (uint32, Shard, error) {
	shard, err := ParseLoadsName(name)
	if err != nil {
		return 0, Shard{}, err
	}
	l := &xdsv1.Loads{}
	if err := decode(LoadsType, res, l); err != nil {
		return 0, Shard{}, err
	}
	sh, err := UnpackLoads(shard, l)
	return shard, sh, err
}

// PushedLoads is what a proxy holds of the Loads resources: each shard as UnpackLoads
// gives it. It is never modified once built: a change builds another.
type PushedLoads struct {
	shards map[uint32]Shard
}

// LoadOf returns the load the control plane pushed for worker w: its Load where it carries
// one (a control plane that pushes loads with the workers), else the entry at its load
// index if that entry is of its id; nil when there is none (the worker and its load are of
// different publications, for a moment).
func (p PushedLoads) LoadOf(w *xdsv1.Worker) *xdsv1.Load {
	if l := w.GetLoad(); l != nil {
		return l
	}
	i := w.GetLoadIndex()
	s, ok := p.shards[i/LoadsShard]
	if !ok || int(i%LoadsShard) >= len(s.Loads) || int(i%LoadsShard) >= len(s.Checks) {
		return nil
	}
	if l := s.Loads[i%LoadsShard]; l != nil && s.Checks[i%LoadsShard] == IDCheck(w.GetId()) {
		return l
	}
	return nil
}

// NewPushedLoads holds each shard as UnpackLoads gave it, by shard number; it keeps
// shards, which the caller must not modify afterwards.
func NewPushedLoads(shards map[uint32]Shard) PushedLoads { return PushedLoads{shards: shards} }
