package imex

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
)

// alloc is one allocation result of a claim: the device the scheduler
// gave its request, and the share of it ("" for the device whole).
type alloc struct {
	request, device, id string
}

// sharedClaim is a channel claim of domainID allocated the results in
// shares, as the scheduler writes them for a device that allows multiple
// allocations.
func sharedClaim(uid, domainID string, shares ...alloc) *resourceapi.ResourceClaim {
	c := channelClaim(uid, "team", "node-a", "", domainID, "")
	c.Status.Allocation.Devices.Results = nil
	for _, s := range shares {
		r := resourceapi.DeviceRequestAllocationResult{Request: s.request, Driver: DriverName, Pool: "node-a", Device: s.device}
		if s.id != "" {
			r.ShareID = ptrUID(s.id)
		}
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results, r)
	}
	return c
}

func ptrUID(s string) *types.UID { u := types.UID(s); return &u }

// Shared channel devices (DRAConsumableCapacity): NVIDIA's default class
// selects channel-0 alone, so every workload claim on a node is allocated
// a share of that one device. Prepare gives each claim its domain's host
// channel whatever the device, answers with the claim's own shares, and
// records them (a restart answers the same).
func TestSharedChannelDevice(t *testing.T) {
	const s1, s2, s3 = "8d1f4c0a-1b2c-4d3e-8f40-5a6b7c8d9e01", "8d1f4c0a-1b2c-4d3e-8f40-5a6b7c8d9e02", "8d1f4c0a-1b2c-4d3e-8f40-5a6b7c8d9e03"
	cases := []struct {
		name   string
		claims []*resourceapi.ResourceClaim
		// same lists groups of claims that share a host channel; claims
		// of different groups have different channels.
		same [][]types.UID
	}{{
		name: "two domains on one node, one share each of channel-0",
		claims: []*resourceapi.ResourceClaim{
			sharedClaim("a", "cd-1", alloc{"channel", "channel-0", s1}),
			sharedClaim("b", "cd-2", alloc{"channel", "channel-0", s2}),
		},
		same: [][]types.UID{{"a"}, {"b"}},
	}, {
		name: "two pods of one domain on one node share its channel",
		claims: []*resourceapi.ResourceClaim{
			sharedClaim("a", "cd-1", alloc{"channel", "channel-0", s1}),
			sharedClaim("b", "cd-1", alloc{"channel", "channel-0", s2}),
		},
		same: [][]types.UID{{"a", "b"}},
	}, {
		name: "two domains, one of them with two pods",
		claims: []*resourceapi.ResourceClaim{
			sharedClaim("a", "cd-1", alloc{"channel", "channel-0", s1}),
			sharedClaim("b", "cd-2", alloc{"channel", "channel-0", s2}),
			sharedClaim("c", "cd-1", alloc{"channel", "channel-0", s3}),
		},
		same: [][]types.UID{{"a", "c"}, {"b"}},
	}, {
		name: "one claim, two requests, two shares of channel-0",
		claims: []*resourceapi.ResourceClaim{
			sharedClaim("a", "cd-1", alloc{"channel", "channel-0", s1}, alloc{"more", "channel-0", s2}),
		},
		same: [][]types.UID{{"a"}},
	}, {
		name: "devices allocated whole (an API server without DRAConsumableCapacity)",
		claims: []*resourceapi.ResourceClaim{
			sharedClaim("a", "cd-1", alloc{"channel", "channel-0", ""}),
			sharedClaim("b", "cd-2", alloc{"channel", "channel-3", ""}),
		},
		same: [][]types.UID{{"a"}, {"b"}},
	}}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n, root := simTray(t, 8)
			domains := &fakeDomains{}
			for _, id := range []string{"cd-1", "cd-2"} {
				domains.put(domain(id, "team", id, cdv1.ComputeDomainNode{Name: "node-a", IPAddress: "10.0.0.1", CliqueID: clique7}))
			}
			state, cdiDir := t.TempDir(), t.TempDir()
			td := newTestDriver(t, root, state, cdiDir, inventoryOf(t, n), fake.NewClientset(), domains)
			td.daemons.setReady("cd-1")
			td.daemons.setReady("cd-2")
			answers := map[types.UID]string{}
			for _, cl := range c.claims {
				res := prepare(t, td.Driver, cl)
				if res.Err != nil {
					t.Fatalf("claim %s: %v", cl.UID, res.Err)
				}
				answers[cl.UID] = answerOf(res.Devices)
				if want := resultsOf(cl); answers[cl.UID] != want {
					t.Errorf("claim %s answered %s, want its allocation's %s", cl.UID, answers[cl.UID], want)
				}
			}
			channels := map[types.UID]int{}
			for _, pc := range td.Status().Claims {
				if len(pc.Channels) != 1 {
					t.Fatalf("claim %s: channels %v, want one", pc.UID, pc.Channels)
				}
				channels[pc.UID] = pc.Channels[0]
				spec := readSpec(t, cdiDir, string(pc.UID))
				if nodes := spec.Devices[0].ContainerEdits.DeviceNodes; len(nodes) != 1 || nodes[0].Minor != int64(pc.Channels[0]) {
					t.Errorf("claim %s: CDI device nodes %+v, want channel %d's alone", pc.UID, nodes, pc.Channels[0])
				}
			}
			groupOf := map[int]int{}
			for g, group := range c.same {
				for _, uid := range group {
					ch, ok := channels[uid]
					switch {
					case !ok:
						t.Fatalf("claim %s not prepared: %v", uid, channels)
					case ch == 0:
						t.Errorf("claim %s got channel 0, NVIDIA's channel for every domain", uid)
					}
					if other, seen := groupOf[ch]; seen && other != g {
						t.Errorf("claims of different domains share channel %d: %v", ch, channels)
					}
					groupOf[ch] = g
					if first := channels[group[0]]; ch != first {
						t.Errorf("claims %s and %s of one domain got channels %d and %d", group[0], uid, first, ch)
					}
				}
			}
			// A restart answers each claim as before, shares included.
			td2 := newTestDriver(t, root, state, cdiDir, inventoryOf(t, n), fake.NewClientset(), domains)
			td2.daemons.setReady("cd-1")
			td2.daemons.setReady("cd-2")
			for _, cl := range c.claims {
				if got := answerOf(prepare(t, td2.Driver, cl).Devices); got != answers[cl.UID] {
					t.Errorf("claim %s after a restart: %s, want %s", cl.UID, got, answers[cl.UID])
				}
			}
		})
	}
}

// sharedDaemonClaim is a daemon claim of domainID (a claim from its
// daemon template) allocated daemon-0, a share of it where id is not "".
func sharedDaemonClaim(uid, domainID, id string) *resourceapi.ResourceClaim {
	c := claimWith(uid, "gpu-agent", "node-a", DaemonDevice, "daemon",
		map[string]any{"apiVersion": cdv1.APIVersion, "kind": cdv1.KindComputeDomainDaemonConfig, "domainID": domainID})
	if id != "" {
		c.Status.Allocation.Devices.Results[0].ShareID = ptrUID(id)
	}
	return c
}

// The daemon device allows multiple allocations as the channels do:
// NVIDIA's daemon class selects daemon-0 alone, and a node runs the
// daemons of several domains, so each domain's daemon claim is a share of
// daemon-0. Prepare takes the domain from the claim's config: each claim
// gets its own domain's identity, whatever the share, and the answer
// names the claim's own share. A restart answers the same.
func TestSharedDaemonDevice(t *testing.T) {
	const s1, s2, s3 = "5e0c9b7a-2f31-4c5d-9e6f-7a8b9c0d1e01", "5e0c9b7a-2f31-4c5d-9e6f-7a8b9c0d1e02", "5e0c9b7a-2f31-4c5d-9e6f-7a8b9c0d1e03"
	cases := []struct {
		name   string
		claims []*resourceapi.ResourceClaim
		// domainOf is the domain each claim's container must be told of.
		domainOf map[types.UID]string
	}{{
		name:     "two domains' daemon claims on one node, a share each of daemon-0",
		claims:   []*resourceapi.ResourceClaim{sharedDaemonClaim("a", "cd-1", s1), sharedDaemonClaim("b", "cd-2", s2)},
		domainOf: map[types.UID]string{"a": "cd-1", "b": "cd-2"},
	}, {
		name: "three domains, the shares given in another order",
		claims: []*resourceapi.ResourceClaim{
			sharedDaemonClaim("c", "cd-3", s1), sharedDaemonClaim("a", "cd-1", s3), sharedDaemonClaim("b", "cd-2", s2),
		},
		domainOf: map[types.UID]string{"a": "cd-1", "b": "cd-2", "c": "cd-3"},
	}, {
		name:     "daemon-0 allocated whole (an API server without DRAConsumableCapacity): one claim per node",
		claims:   []*resourceapi.ResourceClaim{sharedDaemonClaim("a", "cd-2", "")},
		domainOf: map[types.UID]string{"a": "cd-2"},
	}}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n, root := simTray(t, 8)
			domains := &fakeDomains{}
			for _, id := range []string{"cd-1", "cd-2", "cd-3"} {
				domains.put(domain(id, "team-"+id, "name-"+id, cdv1.ComputeDomainNode{Name: "node-a", IPAddress: "10.0.0.1", CliqueID: clique7}))
			}
			state, cdiDir := t.TempDir(), t.TempDir()
			td := newTestDriver(t, root, state, cdiDir, inventoryOf(t, n), fake.NewClientset(), domains)
			answers := map[types.UID]string{}
			for _, cl := range c.claims {
				// A daemon claim does not wait for the daemon: it is what
				// keeps it running.
				res := prepare(t, td.Driver, cl)
				if res.Err != nil {
					t.Fatalf("daemon claim %s: %v", cl.UID, res.Err)
				}
				answers[cl.UID] = answerOf(res.Devices)
				if want := resultsOf(cl); answers[cl.UID] != want {
					t.Errorf("daemon claim %s answered %s, want its allocation's %s", cl.UID, answers[cl.UID], want)
				}
			}
			for uid, dom := range c.domainOf {
				spec := readSpec(t, cdiDir, string(uid))
				if nodes := spec.Devices[0].ContainerEdits.DeviceNodes; len(nodes) != 0 {
					t.Errorf("daemon claim %s: CDI device nodes %+v, want none (a daemon claim gets no channel)", uid, nodes)
				}
				env := spec.Devices[0].ContainerEdits.Env
				for _, e := range []string{"COMPUTE_DOMAIN_UUID=" + dom, "COMPUTE_DOMAIN_NAME=name-" + dom, "COMPUTE_DOMAIN_NAMESPACE=team-" + dom, "CLIQUE_ID=" + clique7} {
					if !slices.Contains(env, e) {
						t.Errorf("daemon claim %s: env %v lacks %s (its own domain's)", uid, env, e)
					}
				}
				for other := range domains.m {
					if other != dom && slices.Contains(env, "COMPUTE_DOMAIN_UUID="+other) {
						t.Errorf("daemon claim %s of %s is told of domain %s: %v", uid, dom, other, env)
					}
				}
			}
			td2 := newTestDriver(t, root, state, cdiDir, inventoryOf(t, n), fake.NewClientset(), domains)
			for _, cl := range c.claims {
				if got := answerOf(prepare(t, td2.Driver, cl).Devices); got != answers[cl.UID] {
					t.Errorf("daemon claim %s after a restart: %s, want %s", cl.UID, got, answers[cl.UID])
				}
			}
		})
	}
}

// answerOf is a Prepare answer's devices as text: request, device, share.
func answerOf(devs []kubeletplugin.Device) string {
	var parts []string
	for _, d := range devs {
		id := ""
		if d.ShareID != nil {
			id = string(*d.ShareID)
		}
		parts = append(parts, fmt.Sprintf("%s=%s/%s", strings.Join(d.Requests, "+"), d.DeviceName, id))
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

// resultsOf is what the answer to claim c must be, in answerOf's form.
func resultsOf(c *resourceapi.ResourceClaim) string {
	var parts []string
	for _, r := range c.Status.Allocation.Devices.Results {
		id := ""
		if r.ShareID != nil {
			id = string(*r.ShareID)
		}
		parts = append(parts, fmt.Sprintf("%s=%s/%s", r.Request, r.Device, id))
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

// recordingSlices stands in for the slice controller: it keeps what it is
// handed.
type recordingSlices struct {
	got []*resourceslice.DriverResources
}

func (r *recordingSlices) Update(res *resourceslice.DriverResources) { r.got = append(r.got, res) }
func (r *recordingSlices) Stop()                                     {}

// device is the last publish's device name.
func (r *recordingSlices) device(t *testing.T, name string) resourceapi.Device {
	t.Helper()
	if len(r.got) == 0 {
		t.Fatal("nothing published")
	}
	for _, s := range r.got[len(r.got)-1].Pools["node-a"].Slices {
		for _, d := range s.Devices {
			if d.Name == name {
				return d
			}
		}
	}
	t.Fatalf("%s not published", name)
	return resourceapi.Device{}
}

func (r *recordingSlices) channels(t *testing.T) []resourceapi.Device {
	t.Helper()
	if len(r.got) == 0 {
		t.Fatal("nothing published")
	}
	var out []resourceapi.Device
	for _, s := range r.got[len(r.got)-1].Pools["node-a"].Slices {
		for _, d := range s.Devices {
			if _, ok := channelID(d.Name); ok {
				out = append(out, d)
			}
		}
	}
	return out
}

// Channels and the daemon device allow multiple allocations; an API
// server that drops the field (DRAConsumableCapacity off, 1.34 and 1.35 by
// default) gets them republished without it, once, whichever device the
// drop was seen on, and /status says that a node serves one channel claim
// and one daemon claim at a time there. The daemon device never carries
// binding conditions. Binding conditions and taints are
// latched the same way; an error that is no dropped field latches nothing.
func TestDroppedFieldsRepublish(t *testing.T) {
	cases := []struct {
		name     string
		features []string // what the API server dropped (DisabledFeatures)
		seenOn   string   // the device the slice controller saw the drop on
		check    func(resourceapi.Device) bool
		// daemonShared: daemon-0 still allows multiple allocations.
		daemonShared bool
		effect       string
	}{
		{"DRAConsumableCapacity", []string{"DRAConsumableCapacity"}, "channel-0",
			func(d resourceapi.Device) bool { return d.AllowMultipleAllocations == nil }, false, "one channel claim per node"},
		{"DRAConsumableCapacity seen on daemon-0", []string{"DRAConsumableCapacity"}, DaemonDevice,
			func(d resourceapi.Device) bool { return d.AllowMultipleAllocations == nil }, false, "one daemon claim per node"},
		{"DRADeviceBindingConditions", []string{"DRADeviceBindingConditions"}, "channel-0",
			func(d resourceapi.Device) bool {
				return len(d.BindingConditions) == 0 && d.AllowMultipleAllocations != nil
			}, true, "Prepare waits"},
		{"both", []string{"DRAConsumableCapacity", "DRADeviceBindingConditions"}, "channel-0",
			func(d resourceapi.Device) bool {
				return len(d.BindingConditions) == 0 && d.AllowMultipleAllocations == nil
			}, false, "one channel claim per node"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n, root := simTray(t, 4)
			td := newTestDriver(t, root, t.TempDir(), t.TempDir(), inventoryOf(t, n), fake.NewClientset(), &fakeDomains{})
			rec := &recordingSlices{}
			td.mu.Lock()
			td.ctrl = rec
			td.updateLocked()
			td.mu.Unlock()
			for _, d := range rec.channels(t) {
				if d.AllowMultipleAllocations == nil || !*d.AllowMultipleAllocations || len(d.BindingConditions) != 1 {
					t.Fatalf("%s before any drop: allowMultipleAllocations %v, binding conditions %v", d.Name, d.AllowMultipleAllocations, d.BindingConditions)
				}
			}
			if d := rec.device(t, DaemonDevice); d.AllowMultipleAllocations == nil || !*d.AllowMultipleAllocations || len(d.BindingConditions) > 0 || len(d.BindingFailureConditions) > 0 {
				t.Fatalf("%s before any drop: allowMultipleAllocations %v, binding conditions %v %v; want shared, none", d.Name, d.AllowMultipleAllocations, d.BindingConditions, d.BindingFailureConditions)
			}
			td.HandleError(context.Background(), droppedError(t, c.seenOn, c.features), "update ResourceSlice")
			if len(rec.got) != 2 {
				t.Fatalf("%d publishes, want the first and one without the dropped fields", len(rec.got))
			}
			for _, d := range rec.channels(t) {
				if !c.check(d) {
					t.Errorf("%s after %v dropped: %+v", d.Name, c.features, d)
				}
			}
			if d := rec.device(t, DaemonDevice); (d.AllowMultipleAllocations != nil) != c.daemonShared || len(d.BindingConditions) > 0 {
				t.Errorf("%s after %v dropped: allowMultipleAllocations %v (want shared: %v), binding conditions %v", d.Name, c.features, d.AllowMultipleAllocations, c.daemonShared, d.BindingConditions)
			}
			off := td.Status().FeaturesOff
			var names []string
			for _, f := range off {
				names = append(names, f.Feature)
			}
			if !reflect.DeepEqual(sortedCopy(names), sortedCopy(c.features)) || !slices.ContainsFunc(off, func(f FeatureOff) bool { return strings.Contains(f.Effect, c.effect) }) {
				t.Errorf("/status featuresOff %+v, want %v, one saying %q", off, c.features, c.effect)
			}
			// The same error again (a slice written before the republish)
			// and an error of another kind publish nothing more.
			td.HandleError(context.Background(), droppedError(t, c.seenOn, c.features), "update ResourceSlice")
			td.HandleError(context.Background(), errors.New("conflict"), "update ResourceSlice")
			if len(rec.got) != 2 {
				t.Errorf("%d publishes after the same drop again, want 2", len(rec.got))
			}
		})
	}
}

func sortedCopy(s []string) []string { s = slices.Clone(s); slices.Sort(s); return s }

// droppedError is the slice controller's error for an API server that
// dropped the fields of features from device.
func droppedError(t *testing.T, device string, features []string) error {
	t.Helper()
	desired := resourceapi.Device{Name: device}
	actual := desired
	for _, f := range features {
		switch f {
		case "DRAConsumableCapacity":
			desired.AllowMultipleAllocations = ptrBool(true)
		case "DRADeviceBindingConditions":
			desired.BindingConditions = []string{ConditionDaemonReady}
			desired.BindingFailureConditions = []string{ConditionDaemonFailed}
		default:
			t.Fatalf("no fixture for %s", f)
		}
	}
	err := &resourceslice.DroppedFieldsError{PoolName: "node-a",
		DesiredSlice: &resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Devices: []resourceapi.Device{desired}}},
		ActualSlice:  &resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Devices: []resourceapi.Device{actual}}}}
	if got := err.DisabledFeatures(); !reflect.DeepEqual(sortedCopy(got), sortedCopy(features)) {
		t.Fatalf("fixture reads as %v dropped, want %v", got, features)
	}
	return err
}

func ptrBool(b bool) *bool { return &b }
