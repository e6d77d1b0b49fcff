package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// fleetNodeName names the i-th fake node.
func fleetNodeName(i int) string { return fmt.Sprintf("fleet-node-%d", i) }

// createNode creates a Node that the scheduler takes as a healthy, empty node: capacity for pods (and CPU
// and memory, which the default profile's resource plugins score), Ready, untainted. The API server ignores
// status on create, so it is set in a second call; its TaintNodesByCondition admission taints every new Node
// not-ready, which the controller manager's node lifecycle controller lifts once the node is Ready: none runs
// here (nor would its taint for the missing kubelet heartbeats be wanted), so a third call lifts it.
func createNode(ctx context.Context, cs kubernetes.Interface, name string) (*corev1.Node, error) {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
		"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
	}}}
	n, err := cs.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create Node %s: %w", name, err)
	}
	res := corev1.ResourceList{
		corev1.ResourceCPU:    apiresource.MustParse("224"),
		corev1.ResourceMemory: apiresource.MustParse("2Ti"),
		corev1.ResourcePods:   apiresource.MustParse("110"),
	}
	now := metav1.Now()
	n.Status = corev1.NodeStatus{
		Capacity: res, Allocatable: res,
		Conditions: []corev1.NodeCondition{{
			Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "FleetBench",
			Message: "a fake node of the fleet benchmark (no kubelet)", LastHeartbeatTime: now, LastTransitionTime: now,
		}},
	}
	n, err = cs.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("Node %s: set Ready: %w", name, err)
	}
	if len(n.Spec.Taints) > 0 {
		n.Spec.Taints = nil
		if n, err = cs.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
			return nil, fmt.Errorf("Node %s: remove the not-ready taint: %w", name, err)
		}
	}
	return n, nil
}

// cloneSlices copies a template's slices onto node: renamed, the node and its pool (the agent names its pool
// after its node), owned by the Node as the agent's are, so the API server validates and stores each as it
// would a real node's.
func cloneSlices(t template, node *corev1.Node) []*resourceapi.ResourceSlice {
	var out []*resourceapi.ResourceSlice
	for i, s := range t.Slices {
		c := s.DeepCopy()
		c.ObjectMeta = metav1.ObjectMeta{
			Name:   fmt.Sprintf("%s-%s-%d", node.Name, driverName, i),
			Labels: s.Labels,
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID, Controller: ptr.To(true),
			}},
		}
		c.Spec.NodeName = ptr.To(node.Name)
		c.Spec.Pool.Name = node.Name
		out = append(out, c)
	}
	return out
}

// parallel runs f(0..n-1) on workers goroutines and returns the errors, at most a few of them: the same
// refusal repeated for every node says no more than once.
func parallel(ctx context.Context, n, workers int, f func(context.Context, int) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	next := make(chan int)
	var mu sync.Mutex
	var errs []error
	failed := 0
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range next {
				if err := f(ctx, i); err != nil {
					mu.Lock()
					failed++
					if len(errs) < 3 {
						errs = append(errs, err)
					}
					mu.Unlock()
					cancel() // the first failure ends the batch: the scenario is not measurable
				}
			}
		})
	}
loop:
	for i := range n {
		select {
		case next <- i:
		case <-ctx.Done():
			break loop
		}
	}
	close(next)
	wg.Wait()
	if failed > 0 {
		return fmt.Errorf("%d of %d failed: %w", failed, n, errors.Join(errs...))
	}
	return context.Cause(ctx)
}

// createFleet creates n Nodes, each with a copy of the slices of the template of its index.
func createFleet(ctx context.Context, cs kubernetes.Interface, n int, tmplOf func(int) template) error {
	return parallel(ctx, n, 16, func(ctx context.Context, i int) error {
		node, err := createNode(ctx, cs, fleetNodeName(i))
		if err != nil {
			return err
		}
		for _, s := range cloneSlices(tmplOf(i), node) {
			if _, err := cs.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("create ResourceSlice %s (%d devices, %d counter sets): %w", s.Name,
					len(s.Spec.Devices), len(s.Spec.SharedCounters), err)
			}
		}
		return nil
	})
}

// sliceBytes is the JSON size of a node's slices as the API server returns them (metadata and managedFields
// included): what every watcher of ResourceSlices (the scheduler, each node's agent) receives for that node.
func sliceBytes(ctx context.Context, cs kubernetes.Interface, node string) (int, error) {
	list, err := cs.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
		FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + node,
	})
	if err != nil {
		return 0, fmt.Errorf("list ResourceSlices of %s: %w", node, err)
	}
	total := 0
	for _, s := range list.Items {
		b, err := json.Marshal(s)
		if err != nil {
			return 0, err
		}
		total += len(b)
	}
	return total, nil
}

// createDeviceClasses creates the DeviceClasses the project ships, from the manifest users apply.
func createDeviceClasses(ctx context.Context, cs kubernetes.Interface, manifest string) error {
	f, err := os.Open(manifest)
	if err != nil {
		return err
	}
	defer f.Close()
	dec := utilyaml.NewYAMLOrJSONDecoder(f, 4096)
	n := 0
	for {
		var dc resourceapi.DeviceClass
		if err := dec.Decode(&dc); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return fmt.Errorf("%s: %w", manifest, err)
		}
		if dc.Name == "" {
			continue // an empty document
		}
		if dc.Kind != "DeviceClass" {
			return fmt.Errorf("%s: %s %s, want only DeviceClasses", manifest, dc.Kind, dc.Name)
		}
		if _, err := cs.ResourceV1().DeviceClasses().Create(ctx, &dc, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create DeviceClass %s: %w", dc.Name, err)
		}
		n++
	}
	if n == 0 {
		return fmt.Errorf("%s: no DeviceClass", manifest)
	}
	return nil
}

// createNamespace creates the benchmark's namespace and its default ServiceAccount, which the ServiceAccount
// admission plugin wants before it admits a pod (the controller manager that would create it does not run).
func createNamespace(ctx context.Context, cs kubernetes.Interface, ns string) error {
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create Namespace %s: %w", ns, err)
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: ns}}
	if _, err := cs.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create ServiceAccount %s/default: %w", ns, err)
	}
	return nil
}

// claimSpec is what one scenario's pods each ask for, in a ResourceClaim of their own.
type claimSpec struct {
	Name string
	Spec resourceapi.ResourceClaimSpec
	// Fits says whether a node of the template has devices the claim can get, and if not why; a claim
	// that fits no node would only measure the scheduler giving up.
	Fits func(template) (bool, string)
}

// claimSpecs are the claims a run can measure; mig-1g asks for one MIG device of migProfile (1g.10gb on an
// H100, 1g.5gb on an A100 40GB, 1g.23gb on a B200).
func claimSpecs(migProfile string) []claimSpec {
	return []claimSpec{
		{
			Name: "1gpu",
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
			}}}},
			Fits: func(t template) (bool, string) {
				return countType(t, "gpu", "") > 0, "no device of type gpu"
			},
		},
		{
			Name: "mig-1g",
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "mig", Exactly: &resourceapi.ExactDeviceRequest{
					DeviceClassName: "mig.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
					Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
						Expression: fmt.Sprintf("device.attributes['gpu.nvidia.com'].profile == %q", migProfile),
					}}},
				},
			}}}},
			Fits: func(t template) (bool, string) {
				return countType(t, "mig", migProfile) > 0, "no MIG device of profile " + migProfile
			},
		},
		{
			Name: "2gpu-nvlink",
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
				Requests: []resourceapi.DeviceRequest{{
					Name: "gpus", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.nvidia.com", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 2},
				}},
				Constraints: []resourceapi.DeviceConstraint{{
					Requests: []string{"gpus"}, MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(driverName + "/nvlinkClique")),
				}},
			}},
			Fits: func(t template) (bool, string) {
				cliques := map[string]int{}
				for _, d := range t.devices() {
					if typ, _ := attr(d, "type"); typ == "gpu" {
						if c, ok := attr(d, "nvlinkClique"); ok {
							cliques[c]++
						}
					}
				}
				for _, n := range cliques {
					if n >= 2 {
						return true, ""
					}
				}
				return false, "no two GPUs of one NVLink clique"
			},
		},
	}
}

// countType counts the template's devices of a type (and MIG profile, when given).
func countType(t template, typ, profile string) int {
	n := 0
	for _, d := range t.devices() {
		got, _ := attr(d, "type")
		p, _ := attr(d, "profile")
		if got == typ && (profile == "" || p == profile) {
			n++
		}
	}
	return n
}

// claimAndPod are the i-th pod of a scenario and its claim. The pod never runs (no kubelet): what is
// measured ends with its binding.
func claimAndPod(ns string, c claimSpec, i int) (*resourceapi.ResourceClaim, *corev1.Pod) {
	name := fmt.Sprintf("fleet-%s-%d", c.Name, i)
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: *c.Spec.DeepCopy()}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app": "fleet-bench"}},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{
				Name: "c", Image: "registry.k8s.io/pause:3.10",
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "dev"}}},
			}},
			ResourceClaims:                []corev1.PodResourceClaim{{Name: "dev", ResourceClaimName: ptr.To(name)}},
			AutomountServiceAccountToken:  ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](0),
		},
	}
	return claim, pod
}

// clearNamespace deletes the namespace's pods and claims and waits until both are gone, so that the next
// scenario's scheduler finds no device allocated. Pods bound to a node wait for its kubelet to confirm their
// end, and there is none: they are deleted with no grace period. The scheduler puts a finalizer on each claim
// it allocates, which the controller manager's resourceclaim controller would take off: it does not run, so
// the benchmark takes it off.
func clearNamespace(ctx context.Context, cs kubernetes.Interface, ns string) error {
	if err := cs.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}, metav1.ListOptions{}); err != nil {
		return fmt.Errorf("delete the pods of %s: %w", ns, err)
	}
	claims, err := cs.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list the ResourceClaims of %s: %w", ns, err)
	}
	err = parallel(ctx, len(claims.Items), 16, func(ctx context.Context, i int) error {
		c := claims.Items[i]
		if len(c.Finalizers) > 0 {
			_, err := cs.ResourceV1().ResourceClaims(ns).Patch(ctx, c.Name, types.MergePatchType,
				[]byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("ResourceClaim %s/%s: remove finalizers: %w", ns, c.Name, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	if err := cs.ResourceV1().ResourceClaims(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		return fmt.Errorf("delete the ResourceClaims of %s: %w", ns, err)
	}
	return pollUntil(ctx, func() error {
		pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		claims, err := cs.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if n, m := len(pods.Items), len(claims.Items); n+m > 0 {
			return fmt.Errorf("%s: %d pods and %d ResourceClaims left", ns, n, m)
		}
		return nil
	})
}

// pollUntil calls f every half second until it returns nil or ctx ends; the error then says what f last
// reported.
func pollUntil(ctx context.Context, f func() error) error {
	for {
		err := f()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(500 * time.Millisecond):
		}
	}
}
