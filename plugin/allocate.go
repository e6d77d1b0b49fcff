package plugin

import (
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/cdi"
)

// visibleDevicesEnv is read by the NVIDIA container runtime hook.
const visibleDevicesEnv = "NVIDIA_VISIBLE_DEVICES"

// allocate answers one Allocate call from one catalog snapshot. Every
// container is checked before any response is returned: the kubelet treats a
// failed Allocate as failing the whole pod, so a partial answer would only
// hide which device was at fault.
func allocate(res *catalog.Resource, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	creqs := req.GetContainerRequests()
	if len(creqs) == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "resource %s: no container requests", res.Name)
	}
	// The kubelet hands out each device once, so a request can never hold
	// more IDs than the resource has devices. Checked before any work: a
	// request near gRPC's 4 MiB limit holds about a million IDs.
	total := 0
	for _, c := range creqs {
		total += len(c.GetDevicesIds())
	}
	if total > len(res.Devices) {
		return nil, status.Errorf(codes.InvalidArgument, "resource %s: %d device IDs requested, more than the %d devices it has",
			res.Name, total, len(res.Devices))
	}
	resp := &pluginapi.AllocateResponse{
		ContainerResponses: make([]*pluginapi.ContainerAllocateResponse, 0, len(creqs)),
	}
	// The kubelet hands a device to one container; one ID in two
	// containers of a request is not its accounting, and would give two
	// containers one device. (One container, as the kubelet asks for
	// each: allocateContainer checks its list.)
	if len(creqs) > 1 {
		owner := make(map[string]int, total)
		for i, creq := range creqs {
			for _, id := range creq.GetDevicesIds() {
				if j, ok := owner[id]; ok && j != i {
					return nil, status.Errorf(codes.InvalidArgument, "resource %s: device %s requested by container requests %d and %d",
						res.Name, quoteID(id), j, i)
				}
				owner[id] = i
			}
		}
	}
	for i, creq := range creqs {
		cresp, err := allocateContainer(res, creq.GetDevicesIds())
		if err != nil {
			return nil, inContainer(i, err)
		}
		resp.ContainerResponses = append(resp.ContainerResponses, cresp)
	}
	return resp, nil
}

// inContainer prefixes a status error's message with the container request
// it concerns and keeps its code. Wrapping with fmt.Errorf instead would
// make gRPC send the whole "rpc error: code = ... desc = ..." text as the
// message of a second status.
func inContainer(i int, err error) error {
	st := status.Convert(err)
	return status.Errorf(st.Code(), "container request %d: %s", i, st.Message())
}

// maxQuotedID is how much of a client's device ID an error message quotes:
// more than any ID of ours, while an ID of megabytes (from a client other
// than the kubelet) cannot make the message, or the log line, that large.
const maxQuotedID = 96

// quoteID quotes a device ID from a request for an error message.
func quoteID(id string) string {
	if len(id) <= maxQuotedID {
		return strconv.Quote(id)
	}
	return strconv.Quote(id[:maxQuotedID]) + fmt.Sprintf("... (%d bytes)", len(id))
}

// allocateContainer builds one container's response: the distinct visible IDs
// in request order, the merged environment, and the de-duplicated device
// nodes and mounts of the requested devices plus the resource's common spec.
func allocateContainer(res *catalog.Resource, ids []string) (*pluginapi.ContainerAllocateResponse, error) {
	if len(ids) == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "resource %s: no device IDs requested", res.Name)
	}
	devs := make([]catalog.Device, 0, len(ids))
	var dup dupChecker
	for i, id := range ids {
		// The kubelet never asks for a device twice; a request that does is
		// not the kubelet's accounting and would be counted twice in it.
		if dup.seenBefore(ids, i) {
			return nil, status.Errorf(codes.InvalidArgument, "resource %s: device %s requested twice", res.Name, quoteID(id))
		}
		d, ok := res.Device(id)
		if !ok {
			return nil, status.Errorf(codes.NotFound, "resource %s: unknown device %s", res.Name, quoteID(id))
		}
		if !d.Healthy {
			reason := d.Reason
			if reason == "" {
				reason = "no reason given"
			}
			return nil, status.Errorf(codes.FailedPrecondition, "resource %s: device %s is unhealthy: %s", res.Name, quoteID(id), reason)
		}
		devs = append(devs, d)
	}
	if res.MaxPerContainer > 0 && len(ids) > res.MaxPerContainer &&
		slices.ContainsFunc(devs, func(d catalog.Device) bool { return d.Replica }) {
		// NVIDIA's wording, so runbooks that match on it keep working.
		return nil, status.Errorf(codes.InvalidArgument, "request for '%s: %d' too large: maximum request size for shared resources is %d",
			res.Name, len(ids), res.MaxPerContainer)
	}

	b := specBuilder{res: res.Name, env: map[string]string{},
		// With CDI alone the spec gives the device nodes, as NVIDIA's plugin
		// leaves out passDeviceSpecs then.
		noNodes: res.Delivery.CDIOnly()}
	// Replicas of one GPU name it once.
	visible := make([]string, 0, len(devs))
	var visibleDup dupChecker
	for _, d := range devs {
		if v := d.Spec.RuntimeName(); v != "" {
			visible = append(visible, v)
			if visibleDup.seenBefore(visible, len(visible)-1) {
				visible = visible[:len(visible)-1]
			}
		}
	}
	// Common first: the control nodes (/dev/nvidiactl, /dev/nvidia-uvm) are
	// listed before the per-GPU nodes, as every NVIDIA runtime does.
	if err := b.add("", res.Common); err != nil {
		return nil, err
	}
	for _, d := range devs {
		if err := b.add(d.ID, d.Spec); err != nil {
			return nil, err
		}
	}
	if err := deliver(&b, res.Delivery, visible); err != nil {
		return nil, status.Errorf(codes.Internal, "resource %s: %v", res.Name, err)
	}
	return b.resp, nil
}

// The volume-mounts strategy: NVIDIA_VISIBLE_DEVICES names this directory
// and each device is an empty mount in it, which the NVIDIA container
// runtime reads (unlike the environment, a pod cannot set mounts there).
const (
	volumeMountsHostPath = "/dev/null"
	volumeMountsRoot     = "/var/run/nvidia-container-devices"
)

// cdiAnnotationPlugin names the agent in cdi-annotations keys.
const cdiAnnotationPlugin = "gpu-agent"

// deliver names the visible devices to the container in each of the
// resource's device list strategies, as NVIDIA's plugin does: envvar sets
// NVIDIA_VISIBLE_DEVICES, volume-mounts overrides it with its directory,
// and the CDI strategies name the agent's CDI devices (nvidia.com/gpu=<id>)
// in an annotation or in the CRI's field.
func deliver(b *specBuilder, d catalog.Delivery, visible []string) error {
	if len(visible) == 0 {
		return nil
	}
	if d.Has("envvar") {
		b.env[visibleDevicesEnv] = strings.Join(visible, ",")
	}
	if d.Has("volume-mounts") {
		b.env[visibleDevicesEnv] = volumeMountsRoot
		for _, id := range visible {
			b.resp.Mounts = append(b.resp.Mounts, &pluginapi.Mount{HostPath: volumeMountsHostPath, ContainerPath: path.Join(volumeMountsRoot, id), ReadOnly: true})
		}
	}
	if !d.Has("cdi-annotations") && !d.Has("cdi-cri") {
		return nil
	}
	names := make([]string, len(visible))
	for i, id := range visible {
		names[i] = cdi.QualifiedName(id)
	}
	if d.Has("cdi-annotations") {
		// A key per response: a container given devices of two resources
		// gets two annotations, which the runtime merges.
		ann, err := cdiapi.UpdateAnnotations(map[string]string{}, cdiAnnotationPlugin, uuid.NewString(), names)
		if err != nil {
			return err
		}
		b.resp.Annotations = map[string]string{}
		for k, v := range ann {
			if d.CDIAnnotationPrefix != "" {
				k = d.CDIAnnotationPrefix + strings.TrimPrefix(k, cdiapi.AnnotationPrefix)
			}
			b.resp.Annotations[k] = v
		}
	}
	if d.Has("cdi-cri") {
		for _, n := range names {
			b.resp.CdiDevices = append(b.resp.CdiDevices, &pluginapi.CDIDevice{Name: n})
		}
	}
	return nil
}

// specBuilder merges AllocateSpecs into one container response.
type specBuilder struct {
	res string
	env map[string]string
	// nodes and mounts are made at the first device node or mount: the
	// default answer has neither.
	nodes  map[string]bool
	mounts map[string]catalog.Mount // by container path
	resp   *pluginapi.ContainerAllocateResponse
	// noNodes drops the specs' device nodes (the CDI spec gives them).
	noNodes bool
}

// add merges the spec of device id ("": the resource's common spec).
func (b *specBuilder) add(id string, s catalog.AllocateSpec) error {
	if b.resp == nil {
		b.resp = &pluginapi.ContainerAllocateResponse{Envs: b.env}
	}
	for k, v := range s.Env {
		if old, ok := b.env[k]; ok && old != v {
			return status.Errorf(codes.InvalidArgument, "resource %s: %s: env %s=%q conflicts with %q", b.res, specName(id), k, v, old)
		}
		b.env[k] = v
	}
	for _, p := range s.DeviceNodes {
		if b.noNodes || b.nodes[p] {
			continue
		}
		if b.nodes == nil {
			b.nodes = map[string]bool{}
		}
		b.nodes[p] = true
		b.resp.Devices = append(b.resp.Devices, &pluginapi.DeviceSpec{ContainerPath: p, HostPath: p, Permissions: "rw"})
	}
	for _, m := range s.Mounts {
		if old, ok := b.mounts[m.ContainerPath]; ok {
			if old != m {
				return status.Errorf(codes.InvalidArgument, "resource %s: %s: mount at %s (from %s) conflicts with one from %s",
					b.res, specName(id), m.ContainerPath, m.HostPath, old.HostPath)
			}
			continue
		}
		if b.mounts == nil {
			b.mounts = map[string]catalog.Mount{}
		}
		b.mounts[m.ContainerPath] = m
		b.resp.Mounts = append(b.resp.Mounts, &pluginapi.Mount{ContainerPath: m.ContainerPath, HostPath: m.HostPath, ReadOnly: m.ReadOnly})
	}
	return nil
}

// specName names the spec of device id ("": the common spec) in messages;
// built only for one, as Allocate is on the container start path.
func specName(id string) string {
	if id == "" {
		return "common spec"
	}
	return "device " + id
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
			return nil, status.Errorf(codes.InvalidArgument, "resource %s: must-include device %s is not available", res.Name, quoteID(id))
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
			// The message only: a status error's full text would nest
			// "rpc error: ..." inside this one.
			return nil, status.Errorf(codes.Internal, "resource %s: preferred allocation: %s", res.Name, status.Convert(err).Message())
		}
	} else {
		ids = defaultPreferred(res, avail, must, size)
	}
	if err := checkPreferred(ids, avail, must, size); err != nil {
		return nil, status.Errorf(codes.Internal, "resource %s: preferred allocation %s rejected: %v", res.Name, summarizeIDs(ids), err)
	}
	return ids, nil
}

// maxListedIDs is how many device IDs a log line or error message lists.
const maxListedIDs = 8

// summarizeIDs lists the first maxListedIDs of ids, quoted, and how many
// there are in all when that is more.
func summarizeIDs(ids []string) string {
	var b strings.Builder
	b.WriteByte('[')
	for i, id := range ids[:min(len(ids), maxListedIDs)] {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(quoteID(id))
	}
	if len(ids) > maxListedIDs {
		fmt.Fprintf(&b, " ... %d in all", len(ids))
	}
	b.WriteByte(']')
	return b.String()
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
			return fmt.Errorf("device %s listed twice", quoteID(id))
		}
		seen[id] = true
		if !avail[id] {
			return fmt.Errorf("device %s is not available", quoteID(id))
		}
	}
	for _, id := range must {
		if !seen[id] {
			return fmt.Errorf("must-include device %s missing", quoteID(id))
		}
	}
	return nil
}

// smallSet is how many strings a duplicate check compares one by one
// before it builds a map: a container asks for a few devices, and a map
// per call is garbage on the container start path.
const smallSet = 16

// dupChecker finds strings seen before in a list walked in order.
type dupChecker struct {
	seen map[string]bool // made once the list is past smallSet
}

// seenBefore reports whether list[i] is one of list[:i]; called for every
// i in order.
func (c *dupChecker) seenBefore(list []string, i int) bool {
	x := list[i]
	if i < smallSet {
		return slices.Contains(list[:i], x)
	}
	if c.seen == nil {
		c.seen = make(map[string]bool, 2*len(list))
		for _, y := range list[:i] {
			c.seen[y] = true
		}
	}
	if c.seen[x] {
		return true
	}
	c.seen[x] = true
	return false
}
