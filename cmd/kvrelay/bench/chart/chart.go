package chart

import (
	"errors"
	"fmt"
	"image/color"
	"math"
	"strconv"
)

// Chart is one figure: lines over a numeric x axis, or bars over named categories.
type Chart struct {
	Title, XLabel, YLabel string
	// FixY fixes the y axis to [YMin, YMax]; otherwise it spans the data (and 0 under bars),
	// widened to whole ticks.
	FixY       bool
	YMin, YMax float64
	// Lines are drawn over a numeric x axis spanning their points, widened to whole ticks.
	Lines []Line
	// Categories, when set, make the x axis nominal, one slot per category, and Bars draws
	// each series' value per category side by side in its slot.
	Categories []string
	Bars       []Bars
	// LegendTop puts the legend in the plot area's upper right corner instead of its lower
	// right. Series without a label have no legend entry; no labels, no legend.
	LegendTop bool
}

// Line is a polyline through Points in order.
type Line struct {
	Label  string
	Points []Point
	Color  color.RGBA // opaque
	// Width is the stroke width in pixels (0: 1.5).
	Width float64
	// Dash alternates drawn and skipped lengths in pixels; empty draws a solid line.
	Dash []float64
}

// Point is a point in data coordinates.
type Point struct{ X, Y float64 }

// Bars is one series of a bar chart: Values[i] is its bar in Categories[i].
type Bars struct {
	Label  string
	Values []float64
	Color  color.RGBA // opaque
}

// palette is gonum/plot's "soft" colours, which the bench figures have always used.
var palette = []color.RGBA{
	{241, 90, 96, 255},
	{122, 195, 106, 255},
	{90, 155, 212, 255},
	{250, 167, 91, 255},
	{158, 103, 171, 255},
	{206, 112, 88, 255},
	{215, 127, 180, 255},
}

// Color returns the i-th colour of the seven-colour palette, cycling.
func Color(i int) color.RGBA {
	n := len(palette)
	return palette[((i%n)+n)%n]
}

// dashes are the patterns Dashes cycles through, in pixels.
var dashes = [][]float64{nil, {8, 3}, {3, 3}, {1.5, 1.5}, {7, 3, 1.5, 3}}

// Dashes returns the i-th dash pattern, cycling: 0 is solid. Lines that share a colour
// (Color cycles after seven) stay apart with a different pattern.
func Dashes(i int) []float64 {
	n := len(dashes)
	return dashes[((i%n)+n)%n]
}

// Gray is the colour a series drawn for reference (an ideal, a bound) takes.
var Gray = color.RGBA{170, 170, 170, 255}

var (
	black     = color.RGBA{0, 0, 0, 255}
	gridColor = color.RGBA{225, 225, 225, 255}
	legendBox = color.RGBA{160, 160, 160, 255}
)

// Text sizes and spacing in pixels.
const (
	titleSize = 16.0
	labelSize = 13.0
	tickSize  = 11.0
	pad       = 12.0
	gap       = 5.0
	tickLen   = 5.0
)

// ErrSize is returned for a width or height below 120 pixels or above 8192.
var ErrSize = errors.New("chart: size out of range")

type rect struct{ x0, y0, x1, y1 float64 }

// noClip is the clip rectangle of what is drawn anywhere.
var noClip = rect{math.Inf(-1), math.Inf(-1), math.Inf(1), math.Inf(1)}

// anchor is where a text's position lies along it.
type anchor int

const (
	start anchor = iota
	middle
	end
)

// painter is what a back end draws with, in pixel coordinates (y down).
type painter interface {
	// measure returns the advance width of s at size.
	measure(s string, size float64) float64
	fillRect(r rect, c color.RGBA)
	// polyline strokes pts, clipped to clip.
	polyline(pts []Point, c color.RGBA, width float64, dash []float64, clip rect)
	// text draws s with its baseline through y; vertical text runs upwards, its baseline
	// the vertical line through x.
	text(x, y float64, s string, size float64, a anchor, vertical bool, c color.RGBA)
}

// axis maps data values to pixels and holds the ticks.
type axis struct {
	lo, hi  float64 // data range
	p0, p1  float64 // pixels of lo and hi
	ticks   []float64
	labels  []string
	nominal bool
}

func (a *axis) px(v float64) float64 {
	return a.p0 + (v-a.lo)/(a.hi-a.lo)*(a.p1-a.p0)
}

// niceTicks returns ticks at a step of 1, 2 or 5 times a power of ten covering [lo, hi] in
// about n steps, with the range widened to whole steps, and their labels.
func niceTicks(lo, hi float64, n int, fixed bool) (float64, float64, []float64, []string) {
	if !(hi > lo) || math.IsInf(hi-lo, 0) {
		d := math.Max(math.Abs(lo)*0.1, 0.5)
		if math.IsNaN(lo) || math.IsInf(lo, 0) {
			lo, d = 0, 0.5
		}
		lo, hi = lo-d, lo+d
	}
	raw := (hi - lo) / float64(n)
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	step := 10 * mag
	switch f := raw / mag; {
	case f <= 1:
		step = mag
	case f <= 2:
		step = 2 * mag
	case f <= 5:
		step = 5 * mag
	}
	first, last := math.Ceil(lo/step-1e-9), math.Floor(hi/step+1e-9)
	if !fixed {
		first, last = math.Floor(lo/step+1e-9), math.Ceil(hi/step-1e-9)
		lo, hi = first*step, last*step
	}
	dec := max(0, int(-math.Floor(math.Log10(step)+1e-9)))
	var ticks []float64
	var labels []string
	for i := first; i <= last; i++ {
		v := i * step
		if v == 0 {
			v = 0 // not -0
		}
		ticks = append(ticks, v)
		labels = append(labels, strconv.FormatFloat(v, 'f', dec, 64))
	}
	return lo, hi, ticks, labels
}

// draw lays the chart out on a w×h canvas and paints it.
func (c *Chart) draw(p painter, w, h float64) {
	p.fillRect(rect{0, 0, w, h}, color.RGBA{255, 255, 255, 255})

	// Data ranges.
	var x, y axis
	ylo, yhi := math.Inf(1), math.Inf(-1)
	if len(c.Categories) > 0 {
		x.nominal = true
		x.lo, x.hi = -0.5, float64(len(c.Categories))-0.5
		for i := range c.Categories {
			x.ticks = append(x.ticks, float64(i))
		}
		x.labels = c.Categories
		ylo, yhi = 0, 0
		for _, b := range c.Bars {
			for _, v := range b.Values {
				if finite(v) {
					ylo, yhi = math.Min(ylo, v), math.Max(yhi, v)
				}
			}
		}
	} else {
		xlo, xhi := math.Inf(1), math.Inf(-1)
		for _, l := range c.Lines {
			for _, pt := range l.Points {
				if finite(pt.X) && finite(pt.Y) {
					xlo, xhi = math.Min(xlo, pt.X), math.Max(xhi, pt.X)
					ylo, yhi = math.Min(ylo, pt.Y), math.Max(yhi, pt.Y)
				}
			}
		}
		if math.IsInf(xlo, 1) {
			xlo, xhi = 0, 1
		}
		x.lo, x.hi, x.ticks, x.labels = niceTicks(xlo, xhi, 6, false)
	}
	if c.FixY {
		ylo, yhi = c.YMin, c.YMax
	} else if math.IsInf(ylo, 1) {
		ylo, yhi = 0, 1
	}
	y.lo, y.hi, y.ticks, y.labels = niceTicks(ylo, yhi, 5, c.FixY)

	// Layout.
	top := pad
	if c.Title != "" {
		top += titleSize*1.25 + gap
	}
	left := pad
	if c.YLabel != "" {
		left += labelSize*1.25 + gap
	}
	yTickW := 0.0
	for _, s := range y.labels {
		yTickW = math.Max(yTickW, p.measure(s, tickSize))
	}
	left += yTickW + gap + tickLen
	bottom := h - pad - tickLen - gap - tickSize
	if c.XLabel != "" {
		bottom -= labelSize*1.25 + gap
	}
	right := w - pad
	if !x.nominal && len(x.labels) > 0 {
		right -= p.measure(x.labels[len(x.labels)-1], tickSize) / 2
	}
	area := rect{left, top, right, bottom}
	x.p0, x.p1 = left, right
	y.p0, y.p1 = bottom, top

	// Title and axis labels.
	if c.Title != "" {
		p.text((left+right)/2, pad+titleSize, c.Title, titleSize, middle, false, black)
	}
	if c.XLabel != "" {
		p.text((left+right)/2, h-pad-labelSize*0.25, c.XLabel, labelSize, middle, false, black)
	}
	if c.YLabel != "" {
		p.text(pad+labelSize, (top+bottom)/2, c.YLabel, labelSize, middle, true, black)
	}

	// Grid, ticks, tick labels.
	full := noClip
	for i, v := range y.ticks {
		py := y.px(v)
		p.polyline([]Point{{left, py}, {right, py}}, gridColor, 1, nil, full)
		p.polyline([]Point{{left - tickLen, py}, {left, py}}, black, 1, nil, full)
		p.text(left-tickLen-gap, py+tickSize*0.35, y.labels[i], tickSize, end, false, black)
	}
	for i, v := range x.ticks {
		px := x.px(v)
		if !x.nominal {
			p.polyline([]Point{{px, top}, {px, bottom}}, gridColor, 1, nil, full)
		}
		p.polyline([]Point{{px, bottom}, {px, bottom + tickLen}}, black, 1, nil, full)
		p.text(px, bottom+tickLen+gap+tickSize*0.8, x.labels[i], tickSize, middle, false, black)
	}

	// Data.
	if x.nominal && len(c.Bars) > 0 {
		slot := (right - left) / float64(len(c.Categories))
		bw := math.Min(40, 0.8*slot/float64(len(c.Bars)))
		for s, b := range c.Bars {
			off := (float64(s) - float64(len(c.Bars)-1)/2) * bw
			for i, v := range b.Values {
				if i >= len(c.Categories) || !finite(v) {
					continue
				}
				cx := x.px(float64(i)) + off
				y0, y1 := y.px(math.Max(y.lo, 0)), y.px(math.Min(math.Max(v, y.lo), y.hi))
				p.fillRect(rect{cx - bw/2, math.Min(y0, y1), cx + bw/2, math.Max(y0, y1)}, b.Color)
			}
		}
	}
	for _, l := range c.Lines {
		if x.nominal {
			break
		}
		pts := make([]Point, 0, len(l.Points))
		for _, pt := range l.Points {
			if finite(pt.X) && finite(pt.Y) {
				pts = append(pts, Point{x.px(pt.X), y.px(pt.Y)})
			}
		}
		width := l.Width
		if width <= 0 {
			width = 1.5
		}
		p.polyline(pts, l.Color, width, l.Dash, area)
	}

	// Axes.
	p.polyline([]Point{{left, top}, {left, bottom}, {right, bottom}}, black, 1, nil, full)

	c.legend(p, area)
}

// legend draws the labelled series' entries in a corner of the plot area.
func (c *Chart) legend(p painter, area rect) {
	type entry struct {
		label string
		line  *Line
		bar   *Bars
	}
	var es []entry
	if len(c.Categories) == 0 {
		for i := range c.Lines {
			if c.Lines[i].Label != "" {
				es = append(es, entry{label: c.Lines[i].Label, line: &c.Lines[i]})
			}
		}
	}
	for i := range c.Bars {
		if c.Bars[i].Label != "" {
			es = append(es, entry{label: c.Bars[i].Label, bar: &c.Bars[i]})
		}
	}
	if len(es) == 0 {
		return
	}
	const swatch, row, inset = 22.0, tickSize * 1.5, 8.0
	textW := 0.0
	for _, e := range es {
		textW = math.Max(textW, p.measure(e.label, tickSize))
	}
	bw, bh := gap+swatch+gap+textW+gap, float64(len(es))*row+gap
	x1 := area.x1 - inset
	y0 := area.y1 - inset - bh
	if c.LegendTop {
		y0 = area.y0 + inset
	}
	box := rect{x1 - bw, y0, x1, y0 + bh}
	p.fillRect(box, color.RGBA{255, 255, 255, 255})
	p.polyline([]Point{{box.x0, box.y0}, {box.x1, box.y0}, {box.x1, box.y1}, {box.x0, box.y1}, {box.x0, box.y0}},
		legendBox, 1, nil, noClip)
	for i, e := range es {
		cy := box.y0 + gap/2 + (float64(i)+0.5)*row
		sx := box.x0 + gap
		if e.line != nil {
			width := e.line.Width
			if width <= 0 {
				width = 1.5
			}
			p.polyline([]Point{{sx, cy}, {sx + swatch, cy}}, e.line.Color, width, e.line.Dash, box)
		} else {
			p.fillRect(rect{sx + 4, cy - 5, sx + swatch - 4, cy + 5}, e.bar.Color)
		}
		p.text(sx+swatch+gap, cy+tickSize*0.35, e.label, tickSize, start, false, black)
	}
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

func checkSize(w, h int) error {
	if w < 120 || h < 120 || w > 8192 || h > 8192 {
		return fmt.Errorf("%w: %d×%d", ErrSize, w, h)
	}
	return nil
}
