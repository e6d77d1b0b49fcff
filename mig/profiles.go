// Package mig plans and applies MIG layouts: it turns the layout an admin
// wants into the fewest GPU instance changes that reach it, and executes them
// through NVML with a journal so that a crash mid-plan resumes and converges.
// Profiles and placements always come from NVML, never from a built-in table.
package mig

import (
	"fmt"
	"slices"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// Profile is one GPU instance profile as NVML reports it for one GPU.
type Profile struct {
	// Name as users write it ("1g.10gb", "1g.10gb+me"), from gpu.MIGProfileName.
	Name string `json:"name"`
	// Index is the GPU_INSTANCE_PROFILE_* value GetGpuInstanceProfileInfo takes.
	Index int                         `json:"index"`
	Info  nvml.GpuInstanceProfileInfo `json:"-"`
	// Placements are every possible placement, occupied or not, ascending.
	Placements []gpu.Placement `json:"placements"`
}

// Profiles maps a profile name to the profile, for one GPU model.
type Profiles map[string]Profile

// ProfileSource is the part of nvml.Device that QueryProfiles reads.
type ProfileSource interface {
	GetGpuInstanceProfileInfo(profile int) (nvml.GpuInstanceProfileInfo, nvml.Return)
	GetGpuInstancePossiblePlacements(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstancePlacement, nvml.Return)
}

// QueryProfiles lists the GPU instance profiles the GPU offers and where each
// may be placed. Profiles the GPU lacks answer NOT_SUPPORTED (or
// INVALID_ARGUMENT on older drivers) and are left out; any other failure is
// an error, because a partial list would make the planner reject layouts
// that are valid.
func QueryProfiles(dev ProfileSource, gpuMemoryBytes uint64) (Profiles, error) {
	out := Profiles{}
	for idx := range nvml.GPU_INSTANCE_PROFILE_COUNT {
		info, ret := dev.GetGpuInstanceProfileInfo(idx)
		switch ret {
		case nvml.SUCCESS:
		case nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_INVALID_ARGUMENT:
			continue
		default:
			return nil, fmt.Errorf("GetGpuInstanceProfileInfo(%d): %w", idx, ret)
		}
		pls, ret := dev.GetGpuInstancePossiblePlacements(&info)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("GetGpuInstancePossiblePlacements(profile %d): %w", idx, ret)
		}
		p := Profile{Name: gpu.MIGProfileName(idx, info, gpuMemoryBytes), Index: idx, Info: info}
		for _, pl := range pls {
			if pl.Start+pl.Size > 32 {
				return nil, fmt.Errorf("profile %s: placement %d+%d beyond 32 memory slices", p.Name, pl.Start, pl.Size)
			}
			p.Placements = append(p.Placements, gpu.Placement{Start: int(pl.Start), Size: int(pl.Size)})
		}
		slices.SortFunc(p.Placements, func(a, b gpu.Placement) int { return a.Start - b.Start })
		if old, dup := out[p.Name]; dup {
			return nil, fmt.Errorf("profiles %d and %d are both named %s", old.Index, idx, p.Name)
		}
		out[p.Name] = p
	}
	return out, nil
}

// byIndex finds the profile with a GPU_INSTANCE_PROFILE_* index.
func (ps Profiles) byIndex(idx int) (Profile, bool) {
	for _, p := range ps {
		if p.Index == idx {
			return p, true
		}
	}
	return Profile{}, false
}

// names lists the profile names, sorted, for error messages.
func (ps Profiles) names() []string {
	out := make([]string, 0, len(ps))
	for n := range ps {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// memorySlices is the number of memory slices the placements span (8 on
// A100 and H100), read from the placements rather than assumed.
func (ps Profiles) memorySlices() int {
	n := 0
	for _, p := range ps {
		for _, pl := range p.Placements {
			n = max(n, pl.Start+pl.Size)
		}
	}
	return n
}

// ordered lists profiles by memory size, largest first, then by index: the
// order in which free space is valued and instances are placed.
func (ps Profiles) ordered() []Profile {
	out := make([]Profile, 0, len(ps))
	for _, p := range ps {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b Profile) int {
		if sa, sb := placementSize(a), placementSize(b); sa != sb {
			return sb - sa
		}
		return a.Index - b.Index
	})
	return out
}

func placementSize(p Profile) int {
	if len(p.Placements) == 0 {
		return 0
	}
	return p.Placements[0].Size
}

func mask(pl gpu.Placement) uint32 { return ((1 << uint(pl.Size)) - 1) << uint(pl.Start) }
