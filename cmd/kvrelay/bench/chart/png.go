package chart

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"io"
	"math"
	"sync"

	"golang.org/x/image/font"
	"golang.org/x/image/font/gofont/goregular"
	"golang.org/x/image/font/opentype"
	"golang.org/x/image/math/fixed"
	"golang.org/x/image/vector"
)

// PNG writes the chart as a w×h PNG image.
func (c *Chart) PNG(wr io.Writer, w, h int) error {
	if err := checkSize(w, h); err != nil {
		return err
	}
	m, err := newMeasurer()
	if err != nil {
		return err
	}
	p := &pngPainter{measurer: m, img: image.NewRGBA(image.Rect(0, 0, w, h))}
	c.draw(p, float64(w), float64(h))
	if err := png.Encode(wr, p.img); err != nil {
		return fmt.Errorf("writing png: %w", err)
	}
	return nil
}

var goRegular = sync.OnceValues(func() (*opentype.Font, error) { return opentype.Parse(goregular.TTF) })

// measurer measures and (for PNG) draws text in Go Regular, one face per size. Faces are not
// safe for concurrent use: each rendering makes its own measurer.
type measurer struct {
	f     *opentype.Font
	faces map[float64]font.Face
}

func newMeasurer() (*measurer, error) {
	f, err := goRegular()
	if err != nil {
		return nil, fmt.Errorf("chart: parsing Go Regular: %w", err)
	}
	return &measurer{f: f, faces: make(map[float64]font.Face)}, nil
}

func (m *measurer) face(size float64) font.Face {
	if f, ok := m.faces[size]; ok {
		return f
	}
	f, err := opentype.NewFace(m.f, &opentype.FaceOptions{Size: size, DPI: 72, Hinting: font.HintingNone})
	if err != nil { // only for a size below zero or not finite, which the layout never asks
		panic(fmt.Sprintf("chart: face of size %v: %v", size, err))
	}
	m.faces[size] = f
	return f
}

func (m *measurer) measure(s string, size float64) float64 {
	return fix(font.MeasureString(m.face(size), s))
}

func fix(v fixed.Int26_6) float64 { return float64(v) / 64 }

type pngPainter struct {
	*measurer
	img *image.RGBA
	ras vector.Rasterizer
}

func (p *pngPainter) fillRect(r rect, c color.RGBA) {
	b := image.Rect(int(math.Round(r.x0)), int(math.Round(r.y0)), int(math.Round(r.x1)), int(math.Round(r.y1)))
	draw.Draw(p.img, b, image.NewUniform(c), image.Point{}, draw.Over)
}

// polyline strokes the line as one quadrilateral per segment (and per dash), all in one
// rasterizer pass, so that overlapping pieces cover a pixel once.
func (p *pngPainter) polyline(pts []Point, c color.RGBA, width float64, dash []float64, clip rect) {
	if len(pts) < 2 {
		return
	}
	// The rasterizer's mask starts at the clip rectangle's corner: paths are drawn relative
	// to it.
	cr := image.Rect(int(math.Floor(math.Max(clip.x0, 0))), int(math.Floor(math.Max(clip.y0, 0))),
		int(math.Ceil(math.Min(clip.x1, 1<<20))), int(math.Ceil(math.Min(clip.y1, 1<<20))))
	cr = cr.Intersect(p.img.Bounds())
	if cr.Empty() {
		return
	}
	p.ras.Reset(cr.Dx(), cr.Dy())
	ox, oy := float64(cr.Min.X), float64(cr.Min.Y)
	half := width / 2
	quad := func(a, b Point) {
		dx, dy := b.X-a.X, b.Y-a.Y
		l := math.Hypot(dx, dy)
		if l == 0 {
			return
		}
		// Extend each piece by half the width at both ends: square caps, and joins without
		// notches.
		ux, uy := dx/l*half, dy/l*half
		nx, ny := -uy, ux
		ax, ay, bx, by := a.X-ux-ox, a.Y-uy-oy, b.X+ux-ox, b.Y+uy-oy
		p.ras.MoveTo(float32(ax+nx), float32(ay+ny))
		p.ras.LineTo(float32(bx+nx), float32(by+ny))
		p.ras.LineTo(float32(bx-nx), float32(by-ny))
		p.ras.LineTo(float32(ax-nx), float32(ay-ny))
		p.ras.ClosePath()
	}
	if len(dash) == 0 {
		for i := 1; i < len(pts); i++ {
			quad(pts[i-1], pts[i])
		}
	} else {
		di, left, on := 0, dash[0], true
		for i := 1; i < len(pts); i++ {
			a, b := pts[i-1], pts[i]
			l := math.Hypot(b.X-a.X, b.Y-a.Y)
			for pos := 0.0; pos < l; {
				step := math.Min(left, l-pos)
				if on {
					t0, t1 := pos/l, (pos+step)/l
					quad(Point{a.X + (b.X-a.X)*t0, a.Y + (b.Y-a.Y)*t0}, Point{a.X + (b.X-a.X)*t1, a.Y + (b.Y-a.Y)*t1})
				}
				pos += step
				left -= step
				if left <= 1e-9 {
					di = (di + 1) % len(dash)
					left, on = math.Max(dash[di], 0.5), !on
				}
			}
		}
	}
	p.ras.Draw(p.img, cr, image.NewUniform(c), image.Point{})
}

func (p *pngPainter) text(x, y float64, s string, size float64, a anchor, vertical bool, c color.RGBA) {
	f := p.face(size)
	w := p.measure(s, size)
	off := 0.0
	switch a {
	case middle:
		off = w / 2
	case end:
		off = w
	}
	src := image.NewUniform(c)
	if !vertical {
		d := font.Drawer{Dst: p.img, Src: src, Face: f, Dot: fixed.Point26_6{X: fixed.Int26_6((x - off) * 64), Y: fixed.Int26_6(y * 64)}}
		d.DrawString(s)
		return
	}
	// Vertical: draw into a mask along the x axis, then turn it a quarter left onto the
	// image. A mask pixel (i, j) (baseline at row asc) lands at (x - asc + j, y + off - i).
	met := f.Metrics()
	asc, desc := met.Ascent.Ceil(), met.Descent.Ceil()
	tw := int(math.Ceil(w))
	if tw <= 0 {
		return
	}
	mask := image.NewAlpha(image.Rect(0, 0, tw, asc+desc))
	d := font.Drawer{Dst: mask, Src: image.Opaque, Face: f, Dot: fixed.Point26_6{Y: fixed.I(asc)}}
	d.DrawString(s)
	rot := image.NewAlpha(image.Rect(0, 0, asc+desc, tw))
	for j := 0; j < asc+desc; j++ {
		for i := 0; i < tw; i++ {
			rot.Pix[(tw-1-i)*rot.Stride+j] = mask.Pix[j*mask.Stride+i]
		}
	}
	x0, y0 := int(math.Round(x))-asc, int(math.Round(y+off))-tw+1
	draw.DrawMask(p.img, image.Rect(x0, y0, x0+asc+desc, y0+tw), src, image.Point{}, rot, image.Point{}, draw.Over)
}
