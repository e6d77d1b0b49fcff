package plugin

import (
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpu-agent/gpu-agent/catalog"
)

// visibleDevicesEnv is read by the NVIDIA container runtime hook.
const visibleDevicesEnv = "NVIDIA_VISIBLE_DEVICES"

// allocate answers one Allocate call from one catalog snapshot. Every
// container is checked before any response is returned: the kubelet treats a
// failed Allocate as failing the whole pod, so a partial answer would only
// hide which device was at fault.
func allocate(res *catalog.Resource, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{
		ContainerResponses: make([]*pluginapi.ContainerAllocateResponse, 0, len(req.GetContainerRequests())),
	}
	for i, creq := range req.GetContainerRequests() {
		cresp, err := allocateContainer(res, creq.GetDevicesIds())
		if err != nil {
			return nil, fmt.Errorf("container request %d: %w", i, err)
		}
		resp.ContainerResponses = append(resp.ContainerResponses, cresp)
	}
	return resp, nil
}

// allocateContainer builds one container's response: the distinct visible IDs
// in request order, the merged environment, and the de-duplicated device
// nodes and mounts of the requested devices plus the resource's common spec.
func allocateContainer(res *catalog.Resource, ids []string) (*pluginapi.ContainerAllocateResponse, error) {
	if len(ids) == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "resource %s: no device IDs requested", res.Name)
	}
	devs := make([]catalog.Device, 0, len(ids))
	for _, id := range ids {
		d, ok := res.Device(id)
		if !ok {
			return nil, status.Errorf(codes.NotFound, "resource %s: unknown device %q", res.Name, id)
		}
		if !d.Healthy {
			reason := d.Reason
			if reason == "" {
				reason = "no reason given"
			}
			return nil, status.Errorf(codes.FailedPrecondition, "resource %s: device %q is unhealthy: %s", res.Name, id, reason)
		}
		devs = append(devs, d)
	}
	if res.MaxPerContainer > 0 && len(ids) > res.MaxPerContainer &&
		slices.ContainsFunc(devs, func(d catalog.Device) bool { return d.Replica }) {
		// NVIDIA's wording, so runbooks that match on it keep working.
		return nil, status.Errorf(codes.InvalidArgument, "request for '%s: %d' too large: maximum request size for shared resources is %d",
			res.Name, len(ids), res.MaxPerContainer)
	}

	b := specBuilder{res: res.Name, env: map[string]string{}, nodes: map[string]bool{}, mounts: map[string]catalog.Mount{}}
	var visible []string
	seenVisible := map[string]bool{}
	for _, d := range devs {
		if v := d.Spec.VisibleID; v != "" && !seenVisible[v] {
			seenVisible[v] = true
			visible = append(visible, v)
		}
	}
	if len(visible) > 0 {
		b.env[visibleDevicesEnv] = strings.Join(visible, ",")
	}
	// Common first: the control nodes (/dev/nvidiactl, /dev/nvidia-uvm) are
	// listed before the per-GPU nodes, as every NVIDIA runtime does.
	if err := b.add("common spec", res.Common); err != nil {
		return nil, err
	}
	for _, d := range devs {
		if err := b.add("device "+d.ID, d.Spec); err != nil {
			return nil, err
		}
	}
	return b.resp, nil
}

// specBuilder merges AllocateSpecs into one container response.
type specBuilder struct {
	res    string
	env    map[string]string
	nodes  map[string]bool
	mounts map[string]catalog.Mount // by container path
	resp   *pluginapi.ContainerAllocateResponse
}

func (b *specBuilder) add(what string, s catalog.AllocateSpec) error {
	if b.resp == nil {
		b.resp = &pluginapi.ContainerAllocateResponse{Envs: b.env}
	}
	for k, v := range s.Env {
		if old, ok := b.env[k]; ok && old != v {
			return status.Errorf(codes.InvalidArgument, "resource %s: %s: env %s=%q conflicts with %q", b.res, what, k, v, old)
		}
		b.env[k] = v
	}
	for _, p := range s.DeviceNodes {
		if b.nodes[p] {
			continue
		}
		b.nodes[p] = true
		b.resp.Devices = append(b.resp.Devices, &pluginapi.DeviceSpec{ContainerPath: p, HostPath: p, Permissions: "rw"})
	}
	for _, m := range s.Mounts {
		if old, ok := b.mounts[m.ContainerPath]; ok {
			if old != m {
				return status.Errorf(codes.InvalidArgument, "resource %s: %s: mount at %s (from %s) conflicts with one from %s",
					b.res, what, m.ContainerPath, m.HostPath, old.HostPath)
			}
			continue
		}
		b.mounts[m.ContainerPath] = m
		b.resp.Mounts = append(b.resp.Mounts, &pluginapi.Mount{ContainerPath: m.ContainerPath, HostPath: m.HostPath, ReadOnly: m.ReadOnly})
	}
	return nil
}

// preferred answers one container's GetPreferredAllocation request with the
// resource's Preferrer, or with the simple default when it has none. The
// answer is validated either way: the kubelet trusts it, so a Preferrer bug
// must surface as an error here rather than as a wrong allocation.
func preferred(res *catalog.Resource, req *pluginapi.ContainerPreferredAllocationRequest) ([]string, error) {
	available := req.GetAvailableDeviceIDs()
	must := req.GetMustIncludeDeviceIDs()
	size := int(req.GetAllocationSize())

	avail := make(map[string]bool, len(available))
	for _, id := range available {
		avail[id] = true
	}
	if size <= 0 {
		return nil, status.Errorf(codes.InvalidArgument, "resource %s: allocation size %d", res.Name, size)
	}
	if len(must) > size {
		return nil, status.Errorf(codes.InvalidArgument, "resource %s: %d must-include devices exceed allocation size %d", res.Name, len(must), size)
	}
	for _, id := range must {
		if !avail[id] {
			return nil, status.Errorf(codes.InvalidArgument, "resource %s: must-include device %q is not available", res.Name, id)
		}
	}
	if len(avail) < size {
		return nil, status.Errorf(codes.InvalidArgument, "resource %s: %d devices available, %d requested", res.Name, len(avail), size)
	}

	var ids []string
	if res.Preferred != nil {
		var err error
		ids, err = res.Preferred.Preferred(available, must, size)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "resource %s: preferred allocation: %v", res.Name, err)
		}
	} else {
		ids = defaultPreferred(res, avail, must, size)
	}
	if err := checkPreferred(ids, avail, must, size); err != nil {
		return nil, status.Errorf(codes.Internal, "resource %s: preferred allocation %v rejected: %v", res.Name, ids, err)
	}
	return ids, nil
}

// defaultPreferred takes the must-include IDs, then available IDs in catalog
// order. Available IDs the catalog does not list (the kubelet's view may lag
// one update behind ours) come last so that a valid request still gets an answer.
func defaultPreferred(res *catalog.Resource, avail map[string]bool, must []string, size int) []string {
	ids := make([]string, 0, size)
	taken := make(map[string]bool, size)
	take := func(id string) {
		if len(ids) < size && avail[id] && !taken[id] {
			taken[id] = true
			ids = append(ids, id)
		}
	}
	for _, id := range must {
		take(id)
	}
	for _, d := range res.Devices {
		take(d.ID)
	}
	if len(ids) < size {
		// Rare path; map order would make the answer unstable, so sort.
		rest := make([]string, 0, len(avail))
		for id := range avail {
			if !taken[id] {
				rest = append(rest, id)
			}
		}
		slices.Sort(rest)
		for _, id := range rest {
			take(id)
		}
	}
	return ids
}

func checkPreferred(ids []string, avail map[string]bool, must []string, size int) error {
	if len(ids) != size {
		return fmt.Errorf("%d devices, want %d", len(ids), size)
	}
	seen := make(map[string]bool, len(ids))
	for _, id := range ids {
		if seen[id] {
			return fmt.Errorf("device %q listed twice", id)
		}
		seen[id] = true
		if !avail[id] {
			return fmt.Errorf("device %q is not available", id)
		}
	}
	for _, id := range must {
		if !seen[id] {
			return fmt.Errorf("must-include device %q missing", id)
		}
	}
	return nil
}
