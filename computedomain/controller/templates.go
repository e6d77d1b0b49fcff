package controller

import (
	"encoding/json"
	"fmt"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// The requests' names, as NVIDIA's templates name them: users' pods refer
// to the claim, not the request, but tools that read claims look for them.
const (
	requestChannel = "channel"
	requestDaemon  = "daemon"
)

// workloadTemplate is the ResourceClaimTemplate named in the domain's
// spec: one channel of the default channel class, with the domain's UID
// and allocation mode in an opaque ComputeDomainChannelConfig. The claims
// made from it carry LabelDomain, which is how the controller finds where
// the workload landed.
func workloadTemplate(cd *cdv1.ComputeDomain) (*resourcev1.ResourceClaimTemplate, error) {
	mode := cdv1.AllocationModeSingle
	if cd.Spec.Channel.AllocationMode != "" {
		mode = cd.Spec.Channel.AllocationMode
	}
	params, err := json.Marshal(cdv1.ComputeDomainChannelConfig{
		APIVersion:     cdv1.APIVersion,
		Kind:           cdv1.KindComputeDomainChannelConfig,
		DomainID:       string(cd.UID),
		AllocationMode: mode,
	})
	if err != nil {
		return nil, fmt.Errorf("domain %s/%s: channel config: %w", cd.Namespace, cd.Name, err)
	}
	labels := map[string]string{LabelDomain: string(cd.UID), LabelTarget: TargetWorkload}
	return &resourcev1.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{
			Name:      cd.Spec.Channel.ResourceClaimTemplate.Name,
			Namespace: cd.Namespace,
			Labels:    labels,
			// The garbage collector deletes the template with its domain
			// even when no controller runs.
			OwnerReferences: []metav1.OwnerReference{ownerRef(cd)},
		},
		Spec: templateSpec(labels, requestChannel, DeviceClassChannel, params),
	}, nil
}

// daemonTemplate is the daemons' ResourceClaimTemplate, in the
// controller's namespace: a daemon device with ComputeDomainDaemonConfig,
// for a node side that runs each domain's IMEX daemon in a pod. A
// namespaced owner must be in its dependant's namespace, so the
// controller, not the garbage collector, deletes it.
func daemonTemplate(cd *cdv1.ComputeDomain, namespace string) (*resourcev1.ResourceClaimTemplate, error) {
	params, err := json.Marshal(cdv1.ComputeDomainDaemonConfig{
		APIVersion: cdv1.APIVersion,
		Kind:       cdv1.KindComputeDomainDaemonConfig,
		DomainID:   string(cd.UID),
	})
	if err != nil {
		return nil, fmt.Errorf("domain %s/%s: daemon config: %w", cd.Namespace, cd.Name, err)
	}
	labels := map[string]string{LabelDomain: string(cd.UID), LabelTarget: TargetDaemon}
	return &resourcev1.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{
			Name:      DaemonTemplateName(string(cd.UID)),
			Namespace: namespace,
			Labels:    labels,
		},
		Spec: templateSpec(labels, requestDaemon, DeviceClassDaemon, params),
	}, nil
}

func templateSpec(labels map[string]string, request, class string, params []byte) resourcev1.ResourceClaimTemplateSpec {
	return resourcev1.ResourceClaimTemplateSpec{
		// Claims made from the template get these labels.
		ObjectMeta: metav1.ObjectMeta{Labels: labels},
		Spec: resourcev1.ResourceClaimSpec{
			Devices: resourcev1.DeviceClaim{
				Requests: []resourcev1.DeviceRequest{{
					Name: request,
					Exactly: &resourcev1.ExactDeviceRequest{
						DeviceClassName: class,
						AllocationMode:  resourcev1.DeviceAllocationModeExactCount,
						Count:           1,
					},
				}},
				Config: []resourcev1.DeviceClaimConfiguration{{
					Requests: []string{request},
					DeviceConfiguration: resourcev1.DeviceConfiguration{
						Opaque: &resourcev1.OpaqueDeviceConfiguration{
							Driver:     DriverName,
							Parameters: runtime.RawExtension{Raw: params},
						},
					},
				}},
			},
		},
	}
}

func ownerRef(cd *cdv1.ComputeDomain) metav1.OwnerReference {
	return metav1.OwnerReference{
		APIVersion:         cdv1.APIVersion,
		Kind:               cdv1.KindComputeDomain,
		Name:               cd.Name,
		UID:                cd.UID,
		BlockOwnerDeletion: new(true),
		Controller:         new(true),
	}
}
