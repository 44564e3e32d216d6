package latency

import "math"

// The decode step against batch size is a table, not a line: one learned step time per
// batch size up to 16, then per bucket of sizes, read by linear interpolation between
// bucket sizes. Each bucket learns the mean log of what its requests' decodes took, and after
// its first few observations moves by a share of each one's log error clipped at three times
// the bucket's running mean absolute log error (at least 10%, at most a factor of two), so an
// outlier moves it a percent or two and a bucket that is wrong converges back within tens of
// observations whatever it was told before (a lasting shift widens the clip as it goes):
// nothing a fit could wind itself into. Published tables are monotone in batch size (the pool-adjacent-violators fit
// of the learned buckets, weighted by their observations) and buckets nothing taught are
// interpolated between the ones that were, or carried flat past them, so a slope only comes
// from what was seen.
var decodeSizes = [...]float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 24, 32, 40, 48, 64, 96, 128, 192, 256}

const numDecode = len(decodeSizes)

// The decode step's multiplier against KV usage is piecewise linear in its log between
// knots at an empty, a half full and a full cache: an empty cache is the reference (1), the
// others learn how much slower a step runs with the cache that full (attention reads more
// context).
const (
	numKV    = 3
	minITL   = 1e-4 // seconds, bounds of a learned step time
	maxITL   = 5.0
	maxKVMul = 4.0
)

// decodeRate is the share of an observation's log error a trained bucket moves by, kvRate a
// band's multiplier; decodeWarm is the observations a bucket takes as a plain running mean
// before its steps are bounded, decodeClamp the most one observation's log error may say.
// decodeMaxWeight caps a bucket's weight in the monotone fit.
const (
	decodeRate      = 0.05
	kvRate          = 0.02
	decodeWarm      = 8
	decodeClamp     = 0.6931471805599453 // ln 2
	decodeMinClamp  = 0.1
	decodeClipK     = 3
	decodeMaxWeight = 50
)

// decodeTable is what the Model learns of the decode step; Model.mu guards it.
type decodeTable struct {
	logT  [numDecode]float64 // learned log step time per bucket (valid where n > 0)
	scale [numDecode]float64 // running mean absolute log error per bucket
	n     [numDecode]int
	logK  [numKV]float64 // log multiplier per KV knot (knot 0 stays 0)
	nK    [numKV]float64 // weight each knot learned from
	count int
}

// kvKnots returns the knots around KV usage kv and the weight of the upper one.
func kvKnots(kv float64) (lo int, w float64) {
	x := min(max(kv, 0), 1) * (numKV - 1)
	lo = min(int(x), numKV-2)
	return lo, x - float64(lo)
}

// bucketOf returns the buckets around batch size b and the weight of the upper one.
func bucketOf(b float64) (lo, hi int, w float64) {
	if b <= decodeSizes[0] {
		return 0, 0, 0
	}
	if b >= decodeSizes[numDecode-1] {
		return numDecode - 1, numDecode - 1, 0
	}
	if b <= 16 {
		i := int(b) - 1
		if float64(i+1) == b {
			return i, i, 0
		}
		return i, i + 1, b - float64(i+1)
	}
	for i := 16; i < numDecode; i++ {
		if decodeSizes[i] >= b {
			w = (b - decodeSizes[i-1]) / (decodeSizes[i] - decodeSizes[i-1])
			return i - 1, i, w
		}
	}
	return numDecode - 1, numDecode - 1, 0
}

// initDecode sets f's decode table to the prior: priorITL at every batch size, whatever the
// cache holds.
func (f *fit) initDecode() {
	for i := range f.step {
		f.step[i] = priorITL
	}
	for i := range f.kv {
		f.kv[i] = 1
	}
}

// decodeStep is f's decode step at batch size b and KV usage kv.
func (f *fit) decodeStep(b int, kv float64) float64 {
	lo, hi, w := bucketOf(float64(b))
	t := f.step[lo]
	if hi != lo {
		t += w * (f.step[hi] - t)
	}
	// Linear between the knots' multipliers: near enough the log-linear curve the knots
	// learn, without an exponential on every prediction.
	k, x := kvKnots(kv)
	lk := f.kv[k]
	return t * (lk + x*(f.kv[k+1]-lk))
}

// logKV is the learned log multiplier at KV usage kv.
func (d *decodeTable) logKV(kv float64) float64 {
	k, f := kvKnots(kv)
	return d.logK[k] + f*(d.logK[k+1]-d.logK[k])
}

// observe learns a request's mean step itl at batch size b and KV usage kv; pub is the fit
// last published.
func (d *decodeTable) observe(pub *fit, b int, kv, itl float64) {
	y := math.Log(min(max(itl, minITL), maxITL))
	// The multiplier learns what the published table (the buckets' view at an empty
	// cache) leaves unexplained, split between the knots around kv.
	r := y - math.Log(pub.decodeStep(b, 0)) - d.logKV(kv)
	k, f := kvKnots(kv)
	for j, wj := range [2]float64{1 - f, f} {
		j += k
		if j == 0 || wj <= 0 {
			continue
		}
		rate := kvRate
		if d.nK[j] < decodeWarm {
			rate = 1 / (d.nK[j] + 2)
		}
		d.logK[j] += wj * rate * min(max(r, -decodeClamp), decodeClamp)
		d.logK[j] = min(max(d.logK[j], -math.Log(maxKVMul)), math.Log(maxKVMul))
		d.nK[j] += wj
	}
	// The buckets learn the step at an empty cache: the observation less the multiplier.
	yb := y - d.logKV(kv)
	lo, hi, w := bucketOf(float64(b))
	d.learn(lo, yb, 1-w)
	if hi != lo {
		d.learn(hi, yb, w)
	}
	d.count++
}

func (d *decodeTable) learn(i int, y, weight float64) {
	if weight <= 0 {
		return
	}
	e := y - d.logT[i]
	switch {
	case d.n[i] == 0:
		d.logT[i], e = y, 0
	case d.n[i] < decodeWarm:
		d.logT[i] += weight * e / float64(d.n[i]+1)
	default:
		c := min(max(decodeClipK*d.scale[i], decodeMinClamp), decodeClamp)
		e = min(max(e, -c), c)
		d.logT[i] += weight * decodeRate * e
	}
	if d.n[i] < decodeWarm {
		d.scale[i] += (math.Abs(e) - d.scale[i]) / float64(d.n[i]+1)
	} else {
		d.scale[i] += weight * 0.05 * (math.Abs(e) - d.scale[i])
	}
	d.n[i]++
}

// publish sets pub's decode table to the monotone, filled table.
func (d *decodeTable) publish(pub *fit) {
	var v, wt [numDecode]float64
	var idx [numDecode]int
	k := 0
	for i := range numDecode {
		if d.n[i] > 0 {
			v[k], wt[k], idx[k] = d.logT[i], float64(min(d.n[i], decodeMaxWeight)), i
			k++
		}
	}
	if k == 0 {
		pub.initDecode()
		return
	}
	isotonic(v[:k], wt[:k])
	var out [numDecode]float64
	j := 0
	for i := range numDecode {
		switch {
		case i <= idx[0]:
			out[i] = v[0]
		case i >= idx[k-1]:
			out[i] = v[k-1]
		default:
			for idx[j+1] <= i {
				j++
			}
			a, b := idx[j], idx[j+1]
			f := (decodeSizes[i] - decodeSizes[a]) / (decodeSizes[b] - decodeSizes[a])
			// Interpolate the step times, not their logs: the step grows about linearly
			// with the batch.
			out[i] = math.Log(math.Exp(v[j]) + f*(math.Exp(v[j+1])-math.Exp(v[j])))
		}
	}
	for i := range numDecode {
		pub.step[i] = math.Exp(out[i])
	}
	for j := range numKV {
		pub.kv[j] = math.Exp(d.logK[j])
	}
}

// isotonic replaces v by its weighted least-squares non-decreasing fit (pool adjacent
// violators), in place.
func isotonic(v, w []float64) {
	n := len(v)
	var val, wsum [numDecode]float64
	var cnt [numDecode]int
	m := 0
	for i := range n {
		val[m], wsum[m], cnt[m] = v[i], w[i], 1
		m++
		for m > 1 && val[m-2] > val[m-1] {
			tw := wsum[m-2] + wsum[m-1]
			val[m-2] = (val[m-2]*wsum[m-2] + val[m-1]*wsum[m-1]) / tw
			wsum[m-2] = tw
			cnt[m-2] += cnt[m-1]
			m--
		}
	}
	i := 0
	for b := range m {
		for range cnt[b] {
			v[i] = val[b]
			i++
		}
	}
}

// DecodePoint is one learned bucket of the decode step, for operators.
type DecodePoint struct {
	Batch        int
	Seconds      float64 // published step at the reference KV band
	Observations int
}
