package sim

import (
	"encoding/binary"
	"fmt"
	"math"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// The load model. A GPU (or, with MIG on, each GPU instance) runs at the
// utilization SetUtilization (SetInstanceUtilization) gave it; everything
// else that moves with load follows from that one number through the
// workload mix below, a tensor-heavy training job. The counters a real GPU
// keeps (busy time per unit, bytes moved) are integrated over the injected
// clock, so GPM's averages between two samples and the NVLink throughput
// counters agree with the utilization in force between them.
const (
	smPerEngine   = 0.85 // SMs with a warp assigned, per unit of engine activity
	occPerEngine  = 0.40 // resident warps of the maximum
	tensorPerEng  = 0.55
	fp64PerEngine = 0.02
	fp32PerEngine = 0.25
	fp16PerEngine = 0.10
	intPerEngine  = 0.08
	// pcieRxAtFull and pcieTxAtFull are the bytes/s moved over PCIe to and
	// from a whole GPU at 100% utilization (input batches in, results out).
	pcieRxAtFull = 6 << 30
	pcieTxAtFull = 2 << 30
	// nvlinkShare is the fraction of NVLink bandwidth a fully busy GPU uses
	// per direction (gradient all-reduce).
	nvlinkShare = 0.30
	// nvlinkDataShare is the payload share of raw NVLink traffic; the rest
	// is protocol overhead (NVML's THROUGHPUT_DATA versus _RAW fields).
	nvlinkDataShare = 0.9
	// gpmMinArch: GPM needs Hopper or newer.
	gpmMinArch = nvml.DEVICE_ARCH_HOPPER
	// codecPeriodUs is the sampling period NVML reports with encoder and
	// decoder utilization.
	codecPeriodUs = 167_000
)

// rates are what a load makes a GPU or GPU instance do per second: busy
// fractions (0-1) and bytes/s.
type rates struct {
	gr, sm, occ, tensor, dram, fp64, fp32, fp16, integer float64
	pcieTx, pcieRx, nvlTx, nvlRx                         float64
}

// activity integrates rates over time: busy seconds and bytes, as the
// hardware counters GPM samples.
type activity struct {
	at time.Time
	rates
}

func (a *activity) advance(now time.Time, r rates) {
	if dt := now.Sub(a.at).Seconds(); dt > 0 && !a.at.IsZero() {
		a.gr += r.gr * dt
		a.sm += r.sm * dt
		a.occ += r.occ * dt
		a.tensor += r.tensor * dt
		a.dram += r.dram * dt
		a.fp64 += r.fp64 * dt
		a.fp32 += r.fp32 * dt
		a.fp16 += r.fp16 * dt
		a.integer += r.integer * dt
		a.pcieTx += r.pcieTx * dt
		a.pcieRx += r.pcieRx * dt
		a.nvlTx += r.nvlTx * dt
		a.nvlRx += r.nvlRx * dt
	}
	a.at = now
}

// loadRates is the workload mix at compute utilization u and memory
// utilization mem (both 0-1), with pcie the share of the GPU's PCIe traffic.
func loadRates(u, mem, pcie float64) rates {
	return rates{
		gr: u, sm: smPerEngine * u, occ: occPerEngine * u, tensor: tensorPerEng * u, dram: mem,
		fp64: fp64PerEngine * u, fp32: fp32PerEngine * u, fp16: fp16PerEngine * u, integer: intPerEngine * u,
		pcieTx: pcieTxAtFull * u * pcie, pcieRx: pcieRxAtFull * u * pcie,
	}
}

// nvlinkLaneBytes is one NVLink lane's bandwidth per direction in bytes/s:
// 25 GB/s from NVLink 2 to 4, doubled from NVLink 5 on.
func (m *model) nvlinkLaneBytes() float64 {
	if m.nvlinkVersion >= 5 {
		return 50e9
	}
	return 25e9
}

// migSlices is the compute slices of the model's full-size GPU instance
// (7 on A100 and H100), the denominator of a GPU instance's share.
func (m *model) migSlices() uint32 {
	var n uint32
	for _, p := range m.mig {
		n = max(n, p.slice)
	}
	return max(n, 1)
}

// gpuRates is what the whole GPU does: its own load, or with MIG on the sum
// of its GPU instances' loads, each weighted by its compute slices (MIG
// instances do not use NVLink). Callers hold n.mu.
func (g *gpuState) gpuRates(m *model) rates {
	if !g.migCurrent {
		u := float64(g.gpuUtil) / 100
		r := loadRates(u, float64(g.memUtil)/100, 1)
		lanes := float64(len(g.links))
		r.nvlTx = nvlinkShare * u * lanes * m.nvlinkLaneBytes()
		r.nvlRx = r.nvlTx
		return r
	}
	var sum rates
	total := float64(m.migSlices())
	for _, gi := range g.gis {
		w := float64(gi.prof.slice) / total
		r := gi.rates(m)
		sum.gr += w * r.gr
		sum.sm += w * r.sm
		sum.occ += w * r.occ
		sum.tensor += w * r.tensor
		sum.dram += w * r.dram
		sum.fp64 += w * r.fp64
		sum.fp32 += w * r.fp32
		sum.fp16 += w * r.fp16
		sum.integer += w * r.integer
		sum.pcieTx += r.pcieTx
		sum.pcieRx += r.pcieRx
	}
	return sum
}

// rates is what a GPU instance does, relative to its own share of the GPU;
// its PCIe traffic is its share of the GPU's.
func (gi *gpuInstance) rates(m *model) rates {
	return loadRates(float64(gi.util)/100, float64(gi.memUtil)/100, float64(gi.prof.slice)/float64(m.migSlices()))
}

// advance brings the GPU's counters (energy, activity of the GPU and of its
// GPU instances) up to now under the load in force until now. Every change
// of load calls it first; callers hold n.mu.
func (g *gpuState) advance(n *Node) {
	now := n.opts.now()
	if dt := now.Sub(g.energyAt).Seconds(); dt > 0 {
		g.energyMJ += float64(g.powerMW) * dt // mW × s = mJ
	}
	g.energyAt = now
	m := n.spec.model
	g.act.advance(now, g.gpuRates(m))
	for _, gi := range g.gis {
		gi.act.advance(now, gi.rates(m))
	}
}

// gpmSupported: GPM (nvmlGpm*) exists from Hopper on.
func (m *model) gpmSupported() bool {
	return m.arch >= gpmMinArch && m.arch != nvml.DEVICE_ARCH_UNKNOWN
}

// hbm says whether the model's memory is HBM, whose stacks have their own
// temperature sensor (NVML's FI_DEV_MEMORY_TEMP); GDDR boards report none.
// The model table has no memory type, so it follows from the memory clock
// NVML reports: below 4.5 GHz for HBM (V100 877, A100 1215, H100 2619 MHz),
// above it for GDDR6 (T4 5001, L40S 9001 MHz).
func (m *model) hbm() bool { return m.maxMemMHz < 4500 }

// codecs says whether the model has video encoders (NVENC) and decoders
// (NVDEC). The table lists engines per MIG profile only: a MIG-capable
// model has what its full-size GPU instance has (A100 and H100: decoders,
// no NVENC); the others simulated (V100, L40S) have both.
func (m *model) codecs() (enc, dec bool) {
	var full *giProfile
	for i := range m.mig {
		if full == nil || m.mig[i].slice > full.slice {
			full = &m.mig[i]
		}
	}
	if full == nil {
		return true, true
	}
	return full.enc > 0, full.dec > 0
}

// reservedMiB is the framebuffer the driver and firmware keep for
// themselves (nvmlMemory_v2_t.reserved). On a MIG-capable model it is what
// the full-size GPU instance does not get; elsewhere 1/128 of the memory.
func (m *model) reservedMiB() uint64 {
	var full uint64
	for _, p := range m.mig {
		full = max(full, p.memMiB)
	}
	if full > 0 && full < m.memMiB {
		return m.memMiB - full
	}
	return m.memMiB / 128
}

// usable is the framebuffer bytes processes can allocate on a whole GPU.
func (m *model) usable() uint64 { return (m.memMiB - m.reservedMiB()) * mib }

// memTempC is the HBM temperature: a few degrees above the GPU's, more
// with memory traffic.
func (g *gpuState) memTempC() uint32 { return g.tempC + 3 + g.memUtil/10 }

// SetInstanceUtilization sets the compute and memory utilization (0-100)
// of GPU instance gi of a MIG-enabled GPU: what GPM reports for it and,
// weighted by its slices, for the whole GPU (NVML reports no
// GetUtilizationRates with MIG on).
func (n *Node) SetInstanceUtilization(gpu, gi int, util, memUtil uint32) error {
	return n.update(gpu, func(g *gpuState) error {
		if util > 100 || memUtil > 100 {
			return fmt.Errorf("utilization %d%%/%d%% above 100%%", util, memUtil)
		}
		for _, x := range g.gis {
			if x.id == gi {
				x.util, x.memUtil = util, memUtil
				return nil
			}
		}
		return fmt.Errorf("no GPU instance %d", gi)
	})
}

// SetCodecUtilization sets the video encoder and decoder utilization
// (0-100) that GetEncoderUtilization and GetDecoderUtilization report.
func (n *Node) SetCodecUtilization(gpu int, enc, dec uint32) error {
	return n.update(gpu, func(g *gpuState) error {
		if enc > 100 || dec > 100 {
			return fmt.Errorf("codec utilization %d%%/%d%% above 100%%", enc, dec)
		}
		g.encUtil, g.decUtil = enc, dec
		return nil
	})
}

// SetPCIeReplays sets the PCIe replay counter (GetPcieReplayCounter). Like
// other telemetry it is not kept in the state file.
func (n *Node) SetPCIeReplays(gpu int, count uint32) error {
	return n.update(gpu, func(g *gpuState) error {
		g.pcieReplays = count
		return nil
	})
}

// GetEncoderUtilization: none on models without NVENC and, as NVML
// documents, none on MIG-enabled GPUs.
func (d *device) GetEncoderUtilization() (uint32, uint32, nvml.Return) {
	return d.codecUtil("GetEncoderUtilization", true)
}

// GetDecoderUtilization: as GetEncoderUtilization, for NVDEC.
func (d *device) GetDecoderUtilization() (uint32, uint32, nvml.Return) {
	return d.codecUtil("GetDecoderUtilization", false)
}

func (d *device) codecUtil(call string, encoder bool) (uint32, uint32, nvml.Return) {
	r := d.lock(call, false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, 0, r
	}
	enc, dec := d.model().codecs()
	if (encoder && !enc) || (!encoder && !dec) || d.g.migCurrent {
		return 0, 0, nvml.ERROR_NOT_SUPPORTED
	}
	if encoder {
		return d.g.encUtil, codecPeriodUs, nvml.SUCCESS
	}
	return d.g.decUtil, codecPeriodUs, nvml.SUCCESS
}

// GetPcieReplayCounter returns what SetPCIeReplays set.
func (d *device) GetPcieReplayCounter() (int, nvml.Return) {
	return get(d, "GetPcieReplayCounter", false, func() int { return int(d.g.pcieReplays) })
}

// allLinks is NVML's scopeId for a field value summed over every NVLink.
const allLinks = math.MaxUint32

// fieldValue answers one field of GetFieldValues; callers hold n.mu and
// advanced the GPU's counters.
func (d *device) fieldValue(v *nvml.FieldValue) {
	g := d.g
	put := func(typ nvml.ValueType, x uint64) {
		v.ValueType = uint32(typ)
		v.NvmlReturn = uint32(nvml.SUCCESS)
		v.Value = [8]byte{}
		if typ == nvml.VALUE_TYPE_UNSIGNED_INT {
			binary.NativeEndian.PutUint32(v.Value[:4], uint32(x))
		} else {
			binary.NativeEndian.PutUint64(v.Value[:], x)
		}
	}
	fail := func(r nvml.Return) { v.NvmlReturn = uint32(r) }
	switch v.FieldId {
	case nvml.FI_DEV_GET_GPU_RECOVERY_ACTION:
		put(nvml.VALUE_TYPE_UNSIGNED_INT, uint64(g.recovery))
	case nvml.FI_DEV_MEMORY_TEMP:
		if !d.model().hbm() {
			fail(nvml.ERROR_NOT_SUPPORTED)
			return
		}
		put(nvml.VALUE_TYPE_UNSIGNED_INT, uint64(g.memTempC()))
	case nvml.FI_DEV_PCIE_REPLAY_COUNTER:
		put(nvml.VALUE_TYPE_UNSIGNED_INT, uint64(g.pcieReplays))
	case nvml.FI_DEV_TOTAL_ENERGY_CONSUMPTION:
		put(nvml.VALUE_TYPE_UNSIGNED_LONG_LONG, uint64(g.energyMJ))
	case nvml.FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nvml.FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
		nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_TX, nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_RX:
		lanes := len(g.links)
		if lanes == 0 {
			fail(nvml.ERROR_NOT_SUPPORTED)
			return
		}
		bytes := g.act.nvlRx
		if v.FieldId == nvml.FI_DEV_NVLINK_THROUGHPUT_DATA_TX || v.FieldId == nvml.FI_DEV_NVLINK_THROUGHPUT_RAW_TX {
			bytes = g.act.nvlTx
		}
		if v.FieldId == nvml.FI_DEV_NVLINK_THROUGHPUT_DATA_TX || v.FieldId == nvml.FI_DEV_NVLINK_THROUGHPUT_DATA_RX {
			bytes *= nvlinkDataShare
		}
		switch {
		case v.ScopeId == allLinks:
		case int(v.ScopeId) < lanes:
			bytes /= float64(lanes) // the load spreads evenly over the lanes
		default:
			fail(nvml.ERROR_INVALID_ARGUMENT)
			return
		}
		put(nvml.VALUE_TYPE_UNSIGNED_LONG_LONG, uint64(bytes/1024)) // KiB
	default:
		fail(nvml.ERROR_NOT_SUPPORTED)
	}
}
