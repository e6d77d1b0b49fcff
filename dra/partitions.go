package dra

import (
	"fmt"
	"slices"
	"strings"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// Counter names of a GPU's counter set. Memory slices are counted one by
// one, so that a device consumes exactly the slices of its placement and the
// scheduler never gives out two overlapping placements; compute slices and
// engines are counted as totals.
const (
	counterCompute     = "compute-slices"
	counterCopyEngines = "copy-engines"
	counterDecoders    = "decoders"
	counterEncoders    = "encoders"
	counterJPEG        = "jpeg-engines"
	counterOFA         = "ofa-engines"
)

// memorySliceCounter names memory slice k.
func memorySliceCounter(k int) string { return fmt.Sprintf("memory-slice-%d", k) }

// Dynamic describes a GPU whose MIG devices are created on demand.
type Dynamic struct {
	GPU      gpu.GPU
	Profiles mig.Profiles
	// Whole: the GPU is also offered whole (MIG mode is off and can be
	// turned on without a reset); it then consumes every counter.
	Whole bool
	// Blocked are placements taken by MIG devices no claim created: they
	// stay as they are (offered as existing MIG devices), and no partition
	// overlapping them is offered.
	Blocked []gpu.Placement
}

// Partitions lists, for a GPU whose MIG devices are created on demand,
// every profile at every placement NVML allows that overlaps nothing in
// Blocked, each consuming its memory slices, compute slices and engines
// from the GPU's counter set, and that counter set. base carries the GPU's
// attributes (and health).
func Partitions(dyn Dynamic, base Device) ([]Device, CounterSet) {
	g := dyn.GPU
	total := map[string]int64{}
	mem := 0
	for _, p := range dyn.Profiles {
		for _, pl := range p.Placements {
			mem = max(mem, pl.Start+pl.Size)
		}
		total[counterCompute] = max(total[counterCompute], int64(p.Info.SliceCount))
		total[counterCopyEngines] = max(total[counterCopyEngines], int64(p.Info.CopyEngineCount))
		total[counterDecoders] = max(total[counterDecoders], int64(p.Info.DecoderCount))
		total[counterEncoders] = max(total[counterEncoders], int64(p.Info.EncoderCount))
		total[counterJPEG] = max(total[counterJPEG], int64(p.Info.JpegCount))
		total[counterOFA] = max(total[counterOFA], int64(p.Info.OfaCount))
	}
	for k := range mem {
		total[memorySliceCounter(k)] = 1
	}
	for name, v := range total {
		if v == 0 {
			delete(total, name)
		}
	}
	set := CounterSet{GPU: g.Index, Counters: total}

	var out []Device
	if dyn.Whole {
		d := base
		d.Name, d.Type, d.UUID, d.Index, d.MemoryBytes = GPUName(g.Index), TypeGPU, g.UUID, g.Index, g.MemoryBytes
		d.Consumes = total
		d.Engines = &Engines{
			Multiprocessors: maxMultiprocessors(dyn.Profiles),
			CopyEngines:     total[counterCopyEngines],
			Decoders:        total[counterDecoders],
			Encoders:        total[counterEncoders],
			JPEGEngines:     total[counterJPEG],
			OFAEngines:      total[counterOFA],
		}
		out = append(out, d)
	}
	for _, p := range dyn.Profiles {
		for _, pl := range p.Placements {
			if slices.ContainsFunc(dyn.Blocked, func(b gpu.Placement) bool { return overlaps(b, pl) }) {
				continue
			}
			d := base
			d.Name, d.Type, d.Partition = PartitionName(g.Index, p.Name, pl.Start), TypeMIG, true
			d.Profile, d.ProfileIndex, d.Placement = p.Name, p.Index, pl
			d.ParentUUID, d.ParentIndex, d.Index = g.UUID, g.Index, -1
			d.MemoryBytes = p.Info.MemorySizeMB << 20
			d.Engines = EnginesOf(p.Info)
			d.Consumes = consumption(p, pl)
			out = append(out, d)
		}
	}
	slices.SortFunc(out, func(a, b Device) int { return strings.Compare(a.Name, b.Name) })
	return out, set
}

// maxMultiprocessors is the most multiprocessors a profile of the GPU has:
// its full-GPU profile's, what the GPU offered whole computes with.
func maxMultiprocessors(ps mig.Profiles) int64 {
	var n int64
	for _, p := range ps {
		n = max(n, int64(p.Info.MultiprocessorCount))
	}
	return n
}

func consumption(p mig.Profile, pl gpu.Placement) map[string]int64 {
	c := map[string]int64{}
	add := func(name string, v uint32) {
		if v > 0 {
			c[name] = int64(v)
		}
	}
	add(counterCompute, p.Info.SliceCount)
	add(counterCopyEngines, p.Info.CopyEngineCount)
	add(counterDecoders, p.Info.DecoderCount)
	add(counterEncoders, p.Info.EncoderCount)
	add(counterJPEG, p.Info.JpegCount)
	add(counterOFA, p.Info.OfaCount)
	for k := pl.Start; k < pl.Start+pl.Size; k++ {
		c[memorySliceCounter(k)] = 1
	}
	return c
}

func overlaps(a, b gpu.Placement) bool {
	return a.Start < b.Start+b.Size && b.Start < a.Start+a.Size
}

// PartitionName names the MIG device of profile at placement start on GPU
// index, e.g. "gpu-0-mig-3g40gb-4" for 3g.40gb at 4: a DNS label, stable
// whether or not the instance exists. The profiles NVIDIA names
// ("<n>g.<m>gb", then "+me", "+me.all", "+gfx" or "-me") must keep distinct
// names: "+" is spelled out, since a +me profile (with the media engines) and
// Blackwell's -me one (without them) may both be on one GPU
// ("gpu-0-mig-1g24gb-plus-me-6", "gpu-0-mig-1g24gb-me-6"); the dot of
// "<n>g.<m>gb" goes, any other dot becomes "-" ("+me.all": "-plus-me-all").
func PartitionName(index int, profile string, start int) string {
	var b strings.Builder
	p := strings.ToLower(profile)
	for i := 0; i < len(p); i++ {
		switch c := p[i]; {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-':
			b.WriteByte(c)
		case c == '+':
			b.WriteString("-plus-")
		case c == '.' && i+1 < len(p) && p[i+1] >= '0' && p[i+1] <= '9':
			// "3g.40gb": the letter before the dot already separates the numbers.
		default:
			b.WriteByte('-')
		}
	}
	return fmt.Sprintf("gpu-%d-mig-%s-%d", index, b.String(), start)
}
